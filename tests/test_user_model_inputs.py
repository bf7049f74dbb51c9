"""User models whose example inputs are malformed (the factories below are loaded as
`tests.test_user_model_inputs:NAME`, like a user's package)."""

import json

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from cli.main import app

runner = CliRunner()


class _Returns(nn.Module):
    """A model whose example_batch returns what `made(batch, device)` makes."""

    def __init__(self, made) -> None:
        super().__init__()
        self.made = made
        self.layer = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    @staticmethod
    def loss(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return out.float().mean()

    def example_batch(self, batch: int, seq_len, device):
        return self.made(batch, device)


def returns_string():
    return _Returns(lambda b, d: "xy")  # two characters: it unpacks into (inputs, targets)


def returns_none():
    return _Returns(lambda b, d: None)


def returns_a_tensor():
    return _Returns(lambda b, d: torch.zeros(2, 8, device=d))


def returns_three():
    return _Returns(lambda b, d: ((torch.zeros(b, 8, device=d),), None, "extra"))


def returns_a_string_input():
    return _Returns(lambda b, d: (("tokens",), None))


def returns_no_inputs():
    return _Returns(lambda b, d: ((), None))


def returns_cpu_tensors():
    return _Returns(lambda b, d: ((torch.zeros(b, 8),), torch.zeros(b)))


def returns_a_bare_input():
    return _Returns(lambda b, d: (torch.zeros(b, 8, device=d), torch.zeros(b, device=d)))


def inputs_returns_none():
    return _Returns(None), lambda batch, seq_len, device: None


@pytest.mark.parametrize("factory, needle", [
    ("returns_string", "returned str 'xy'"),
    ("returns_none", "returned None"),
    ("returns_a_tensor", "returned a meta tensor of shape (2, 8)"),
    ("returns_three", "returned a tuple of 3 item(s)"),
    ("returns_a_string_input", "returned str 'tokens' among its inputs"),
    ("returns_no_inputs", "returned no inputs"),
    ("returns_cpu_tensors", "returned a cpu tensor of shape (1, 8), not on meta"),
])
def test_a_malformed_example_batch_names_the_model_and_what_it_must_return(factory, needle):
    target = f"tests.test_user_model_inputs:{factory}"
    result = runner.invoke(app, ["trace", target])
    assert result.exit_code == 1, result.output
    message = " ".join(result.stderr.split())
    assert (f"Model '{target}': its example_batch(batch=1, seq_len=None, device='meta') "
            f"{needle}; it must return (inputs, targets)") in message
    assert "fix the model's example_batch()" in message
    assert "internal error" not in result.output and "Traceback" not in result.output


def test_a_malformed_inputs_function_names_the_model_and_what_it_must_return():
    result = runner.invoke(app, ["trace", "tests.test_user_model_inputs:inputs_returns_none"])
    assert result.exit_code == 1, result.output
    assert ("its inputs(batch=1, seq_len=None, device='meta') returned None as its inputs; "
            "it must return the forward's inputs") in " ".join(result.stderr.split())


def test_a_single_input_tensor_is_one_input_not_its_rows():
    """(x, y) with a bare x is the forward's one input, as from a data hook or inputs();
    it used to be split into its rows (a quarter of the FLOPs traced at batch 4)."""
    result = runner.invoke(app, ["trace", "tests.test_user_model_inputs:returns_a_bare_input",
                                 "--batch", "4", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["per_sample"]["fwd_flops"] == 2 * 8 * 8
