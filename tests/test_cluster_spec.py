"""Cluster specs: YAML files, the inline shorthand, examples, round trips, bad input."""

import textwrap

import pytest
import yaml

from cost_models.cluster import cluster_to_dict, example_names, load_cluster, parse_cluster
from cost_models.yamlfile import load_yaml
from planner.errors import PlannerError
from planner.units import parse_bandwidth, parse_bytes, parse_duration, parse_flops


def write(tmp_path, text: str):
    path = tmp_path / "c.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


GOOD = """\
    schema_version: 1
    name: lab
    network: {bandwidth: 100Gbps, latency: 5us}
    groups:
      - {name: site, bandwidth: 400Gbps, latency: 2us}
      - {name: rack, parent: site, bandwidth: 800Gbps}
    nodes:
      - name: a100
        count: 2
        device: A100-80G-SXM
        devices: 8
        group: rack
      - hosts: [gpu-v1, gpu-v2]
        device: V100-32G
        devices: 4
        nic: 25Gbps
      - name: custom
        device: {name: MyAccel, memory: 24GiB, memory_bandwidth: 900GB/s,
                 peak_flops: {bf16: 100TFLOPS, fp32: 25TFLOPS}, intra_link: pcie4}
        devices: 2
    """


def test_a_hand_written_file(tmp_path):
    c = load_cluster(write(tmp_path, GOOD))
    assert [n.name for n in c.nodes] == ["a100-0", "a100-1", "gpu-v1", "gpu-v2", "custom"]
    assert c.num_devices == 8 * 2 + 4 * 2 + 2
    assert c.nodes[0].groups == ("site", "rack")
    assert c.nodes[2].host == "gpu-v1"
    assert c.link_between("a100-0", "a100-1").bandwidth == 100e9  # the rack link
    assert c.link_between("a100-0", "gpu-v1").bandwidth == 25e9 / 8  # capped by the NIC
    assert c.link_between("gpu-v1", "gpu-v1").name.startswith("NVLink 2")
    custom = c.node("custom").device
    assert custom.memory == 24 * 2**30 and custom.peak_flops == {"bf16": 100e12, "fp32": 25e12}


def test_inline_shorthand():
    c = load_cluster("2x8xA100-80G,4x8xV100-32G@100Gbps")
    assert [n.devices for n in c.nodes] == [8] * 6
    assert [n.device.name for n in c.nodes] == ["A100-80G-SXM"] * 2 + ["V100-32G"] * 4
    assert c.network.bandwidth == 12.5e9
    single = load_cluster("4xRTX4090")
    assert len(single.nodes) == 1 and single.num_devices == 4
    assert load_cluster("2x8xH100@400Gbps/2us").network.latency == 2e-6
    for spec in ("2x8xH100@25GB/s", "2x8xH100@25 GB/s", "2x8xH100@25GB/s/2us"):
        network = load_cluster(spec).network  # the '/' of "GB/s" is no latency separator
        assert (network.bandwidth, network.latency) == (25e9, 2e-6 if "us" in spec else 5e-6)


@pytest.mark.parametrize("name", example_names())
def test_examples_load_and_round_trip(name):
    c = load_cluster(name)
    text = yaml.safe_dump(cluster_to_dict(c), sort_keys=False)
    assert parse_cluster(load_yaml(text, "again"), "again") == c


def test_example_set():
    assert {"dgx-a100-pod", "a100-v100-lab", "consumer-rtx", "four-type-1024"} <= set(
        example_names())
    big = load_cluster("four-type-1024")
    assert big.num_devices == 1024 and len(big.nodes) == 128
    assert len(big.device_types()) == 4


def test_round_trip_of_a_file(tmp_path):
    c = load_cluster(write(tmp_path, GOOD))
    again = parse_cluster(load_yaml(yaml.safe_dump(cluster_to_dict(c)), "x"), "x")
    assert again == c


def test_units():
    assert parse_bandwidth("100Gbps") == 12.5e9
    assert parse_bandwidth("25 GB/s") == 25e9
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("40 GB") == 40e9
    assert parse_duration("5us") == 5e-6
    assert parse_duration("1.5ms") == 1.5e-3
    assert parse_flops("312 TFLOPS") == 312e12


@pytest.mark.parametrize("text, needle", [
    ("nodes: [{name: a, device: A100-80G-SXM, devices: 0}]",
     "line 1, nodes[0].devices: must be a positive integer (got 0)"),
    ("nodes:\n  - name: a\n    device: A100-80GG\n    devices: 8\n",
     "line 3, nodes[0].device: Unknown device"),
    ("nodes:\n  - {name: a, device: A100-80G, devices: 8}\n  - {name: b, device: A100-80G, "
     "devices: 8}\n", "is missing field 'network'"),
    ("network: 10 parsecs\nnodes: [{name: a, device: A100-80G, devices: 8}]",
     "line 1, network: Cannot read '10 parsecs' as a bandwidth"),
    ("network: {bandwidth: -5Gbps}\nnodes: [{name: a, device: A100-80G, devices: 8}]",
     "network.bandwidth"),
    ("nodes: [{hosts: [h1, h1], device: A100-80G, devices: 8}]", "host 'h1' is listed twice"),
    ("network: 1Gbps\nnodes: [{name: a, device: A100-80G, devices: 8},"
     " {name: a, device: A100-80G, devices: 8}]", "node name 'a' is used twice"),
    ("schema_version: 2\nnodes: [{name: a, device: A100-80G, devices: 8}]",
     "schema_version 2 is not supported"),
    ("nodes: [{name: a, device: A100-80G, devices: 8, colour: red}]", "unknown field 'colour'"),
    ("nodes: [{name: a, device: A100-80G, devices: 8, group: rack}]", "unknown group 'rack'"),
    ("nodes: [{name: a, devices: 8}]", "is missing field 'device'"),
    ("nodes:\n  - name: a\n    device: [V100-16G]\n    devices: 2\n",
     "line 3, nodes[0].device: must be a catalog device name (like V100-16G) or a mapping"),
    ("nodes:\n  - name: a\n    device: A100-80G\n    devcies: 8\n",
     "line 4, nodes[0].devcies: unknown field 'devcies'"),  # not "missing field 'devices'"
    ("node: [{name: a, device: A100-80G, devices: 8}]", "line 1, node: unknown field 'node'"),
    ("nodes:\n  - name: a\n    device: {base: A100-80G, memory: 0GiB}\n    devices: 2\n",
     "line 3, nodes[0].device.memory: must be positive (got '0GiB')"),
    ("nodes:\n  - name: a\n    device: {base: A100-80G, peak_flops: {bf16: 0TFLOPS}}\n"
     "    devices: 2\n", "line 3, nodes[0].device.peak_flops.bf16: compute rate must be "
     "positive"),
    ("nodes: [{name: a, device: {base: A100-80G, peak_flops: {fp8: 1TFLOPS}}, devices: 2}]",
     "nodes[0].device.peak_flops.fp8: unknown dtype 'fp8'"),
    ("nodes: [{name: a, device: {base: A100-80G, peak_flops: {bf16: }}, devices: 2}]",
     "nodes[0].device.peak_flops.bf16: needs a value"),
    ("nodes:\n  - name: a\n    device:\n      name: X\n      memory: 24GiB\n"
     "      memory_bandwidth: 900GB/s\n      peak_flops: {}\n    devices: 2\n",
     "line 7, nodes[0].device.peak_flops: a custom device needs peak_flops with an fp32"),
    ("nodes: [{name: a, device: {name: X, memory: 1GiB, memory_bandwidth: 1GB/s, "
     "peak_flops: {bf16: 1TFLOPS}}, devices: 2}]", "needs peak_flops with an fp32 rate"),
    ("nodes: [{name: a, device: cpu, devices: 1, measured: {matmul_flops: {fp8: 1GFLOPS}}}]",
     "nodes[0].measured.matmul_flops.fp8: unknown dtype 'fp8'"),
    ('nodes: [{hosts: ["h1\\nrm -rf ~"], device: A100-80G, devices: 8}]',
     "line 1, nodes[0].hosts: 'h1\\nrm -rf ~' has a line break"),
    ('name: "c1\\nrm -rf ~"\nnodes: [{name: a, device: A100-80G, devices: 8}]',
     "line 1, name: 'c1\\nrm -rf ~' has a line break"),
    ('nodes: [{name: a, device: {base: A100-80G, name: "X\\n# y"}, devices: 8}]',
     "line 1, nodes[0].device.name: 'X\\n# y' has a line break"),
    ("nodes: []", "must be a non-empty list"),
    # NaN and infinity read as numbers but price nothing: refused where they are
    ("network: {bandwidth: .nan}\nnodes: [{name: a, device: A100-80G, devices: 8},"
     " {name: b, device: A100-80G, devices: 8}]",
     "line 1, network.bandwidth: bandwidth must be a finite number (got nan)"),
    ("nodes:\n  - name: a\n    device: {base: A100-80G, memory: .inf}\n    devices: 2\n",
     "line 3, nodes[0].device.memory: size must be a finite number (got inf)"),
    ("nodes:\n  - name: a\n    device: {base: A100-80G, peak_flops: {bf16: .nan}}\n"
     "    devices: 2\n", "nodes[0].device.peak_flops.bf16: compute rate must be a finite"),
    ("a: " + "[" * 100_000, "its YAML nests deeper than any cluster file does"),
    ("nodes:\n  - name: a\n    device: {base: A100-80G, memory: 1}\n    devices: 2\n",
     "line 3, nodes[0].device.memory: 1B is no more than the 1GiB the framework keeps"),
    ("network: 1Gbps\nnodes: [{name: a, count: 1000000000, device: A100-80G, devices: 8}]",
     "line 2, nodes[0].count: the cluster has 1,000,000,000 nodes (or more)"),
    ("nodes: [{name: a, device: A100-80G, devices: 8}\n", "not valid YAML"),
    ("groups: [{name: x, parent: y, bandwidth: 1Gbps}, {name: y, parent: x, bandwidth: 1Gbps}]"
     "\nnodes: [{name: a, device: A100-80G, devices: 8}]", "cycle"),
    # a negative card read as a link name ("Unknown link type"), an empty file as "got
    # NoneType"
    ("nodes:\n  - {name: a, device: A100-80G, devices: 8, nic: -100Gbps}\n",
     "line 2, nodes[0].nic: bandwidth must be positive (got -100Gbps)"),
    ("nodes:\n  - {name: a, device: A100-80G, devices: 8, nic: {bandwidth: -1GB/s}}\n",
     "line 2, nodes[0].nic.bandwidth: bandwidth must be positive (got -1GB/s)"),
    ("", "is empty; a cluster file is YAML: a mapping of schema_version, name, network and "
     "nodes"),
    ("# nothing but a comment\n", "is empty"),
    ("nodes: [~]", ", nodes[0]: must be a mapping (it is empty)"),
])
def test_bad_files_name_file_line_and_field(tmp_path, text, needle):
    path = write(tmp_path, text)
    with pytest.raises(PlannerError) as err:
        load_cluster(path)
    assert needle in err.value.message
    assert path in err.value.message


@pytest.mark.parametrize("name", ["lab.yaml", "lab"])
def test_a_folder_is_named_as_a_folder(tmp_path, name):
    """It read "does not exist" (or, without a suffix, "not a file, a built-in example or
    an inline spec"); the cluster files in it are offered."""
    folder = tmp_path / name
    folder.mkdir()
    (folder / "a.yaml").write_text("schema_version: 1\n")
    with pytest.raises(PlannerError) as err:
        load_cluster(str(folder))
    assert err.value.message.startswith(f"'{folder}' is a folder, not a cluster file; a "
                                        "cluster file is YAML")
    assert err.value.remedies[0] == "pass one of its files: a.yaml"
    assert "docs/clusters.md" in err.value.remedies[1]


def test_a_binary_cluster_file_is_named(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(PlannerError, match="is not a text file: byte 0 is not UTF-8") as err:
        load_cluster(str(path))
    assert str(path) in err.value.message


@pytest.mark.parametrize("spec, needle", [
    ("2x0xA100-80G", "zero nodes or devices"),
    ("2x8xA999", "Unknown device"),
    ("dgx-a100-pd", "Did you mean 'dgx-a100-pod'"),
    ("1x8xA100", "Did you mean 'A100-40G-SXM', 'A100-80G-SXM'"),  # the names it begins
    ("missing.yaml", "does not exist"),
    ("2x8xA100-80G@fast", "Cannot read 'fast' as a bandwidth"),
    ("2x8xA100-80G@1e400Gbps", "must be a finite number (got 1e400Gbps)"),
    ("4000x8xA100-80G,100x8xV100-32G", "has 4,100 nodes (or more); the planner plans for "
     "clusters of up to 4,096 nodes"),
    # (100,000 devices in one node ran the search's set-up for minutes past any time limit)
    ("1x100000xA100-80G", "puts 100,000 devices in one node; the planner plans for nodes of "
     "up to 1,024"),
])
def test_bad_specs(spec, needle):
    with pytest.raises(PlannerError, match=None) as err:
        load_cluster(spec)
    assert needle in err.value.message


def test_a_node_of_too_many_devices_is_named_in_a_file_and_a_resize(tmp_path):
    from planner.whatif import resize_node

    path = tmp_path / "big.yaml"
    path.write_text("schema_version: 1\nname: x\nnodes:\n"
                    "  - {name: a, device: V100-16G, devices: 5000}\n")
    with pytest.raises(PlannerError, match=r"line 4, nodes\[0\].devices: 5,000 devices in one "
                       "node"):
        load_cluster(str(path))
    with pytest.raises(PlannerError, match="Resizing v100-16g-0 puts 5,000 devices in one node"):
        resize_node(load_cluster("1x8xV100-16G"), "v100-16g-0", 5000)


def test_a_custom_device_named_like_another_is_refused(tmp_path):
    """The planner keeps a type's figures by its name: node d's 40 GiB A100s were shown
    (and could be priced) as the custom 80 GiB ones."""
    from planner.whatif import add_nodes

    path = tmp_path / "same.yaml"
    path.write_text("schema_version: 1\nname: t\nnetwork: 100Gbps\nnodes:\n"
                    "  - name: c\n    device: {base: A100-40G-SXM, name: A100-40G-SXM, "
                    "memory: 80GiB}\n    devices: 2\n"
                    "  - {name: d, device: A100-40G-SXM, devices: 2}\n")
    with pytest.raises(PlannerError, match="nodes 'c' and 'd' both have device type "
                       r"'A100-40G-SXM', with different figures \(memory 80 and"):
        load_cluster(str(path))
    path.write_text(path.read_text().replace("  - {name: d, device: A100-40G-SXM, devices: 2}\n",
                                             ""))
    custom = load_cluster(str(path))
    with pytest.raises(PlannerError, match="Adding '1x2xA100-40G': nodes 'c' and "
                       "'a100-40g-sxm-0' both have device type"):
        add_nodes(custom, "1x2xA100-40G")


def test_a_count_beside_a_hosts_list_must_agree(tmp_path):
    """It was ignored: one node per host."""
    path = tmp_path / "hosts.yaml"
    path.write_text("schema_version: 1\nname: t\nnetwork: 100Gbps\nnodes:\n"
                    "  - {hosts: [h1], count: 3, device: V100-16G, devices: 2}\n")
    with pytest.raises(PlannerError, match=r"nodes\[0\].count: gives 3 nodes but lists 1 hosts"):
        load_cluster(str(path))
    path.write_text(path.read_text().replace("count: 3", "count: 1"))
    assert [n.host for n in load_cluster(str(path)).nodes] == ["h1"]
