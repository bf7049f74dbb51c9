"""Vision flavors: ViT (patch embedding + transformer blocks) and torchvision-style ResNet."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from planner.models.configs import ResNetConfig, ViTConfig
from planner.models.stack import Stack
from planner.models.transformer import Block


class PatchEmbedding(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.proj = nn.Conv2d(cfg.channels, cfg.hidden, cfg.patch, stride=cfg.patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, cfg.hidden))
        self.positions = nn.Parameter(torch.zeros(1, cfg.seq_len, cfg.hidden))
        nn.init.normal_(self.positions, std=0.02)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.proj(images).flatten(2).transpose(1, 2)
        x = torch.cat((self.cls.expand(x.shape[0], -1, -1), x), dim=1)
        return x + self.positions


class ClassifierHead(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(cfg.hidden, eps=1e-6)
        self.output = nn.Linear(cfg.hidden, cfg.classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(x)[:, 0])


def classification_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), labels)


def random_images(batch: int, channels: int, size: int, classes: int,
                  device: torch.device | str, generator: torch.Generator | None
                  ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    if torch.device(device).type == "meta":
        return ((torch.zeros(batch, channels, size, size, device=device),),
                torch.zeros(batch, dtype=torch.long, device=device))
    images = torch.randn(batch, channels, size, size, generator=generator).to(device)
    labels = torch.randint(0, classes, (batch,), generator=generator).to(device)
    return (images,), labels


class ViT(Stack):
    """Images [batch, 3, H, W] -> class logits."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = PatchEmbedding(cfg)
        block_cfg = cfg.block_config()
        self.layers = nn.ModuleList(Block(block_cfg) for _ in range(cfg.layers))
        self.head = ClassifierHead(cfg)

    loss = staticmethod(classification_loss)

    def example_batch(self, batch: int, seq_len: int | None, device: torch.device | str,
                      generator: torch.Generator | None = None):
        cfg = self.cfg
        return random_images(batch, cfg.channels, cfg.image_size, cfg.classes, device, generator)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int) -> None:
        super().__init__()
        out = planes * self.expansion
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.downsample = (nn.Sequential(nn.Conv2d(inplanes, out, 1, stride=stride, bias=False),
                                         nn.BatchNorm2d(out))
                           if stride != 1 or inplanes != out else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        return F.relu(self.bn3(self.conv3(y)) + identity)


class Stem(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
        self.bn = nn.BatchNorm2d(width)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return F.max_pool2d(F.relu(self.bn(self.conv(images))), 3, stride=2, padding=1)


class PoolHead(nn.Module):
    def __init__(self, channels: int, classes: int) -> None:
        super().__init__()
        self.output = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class ResNet(Stack):
    """Images [batch, 3, H, W] -> class logits (torchvision's Bottleneck ResNet)."""

    def __init__(self, cfg: ResNetConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = Stem(cfg.width)
        layers, inplanes = [], cfg.width
        for stage, count in enumerate(cfg.blocks):
            planes = cfg.width * 2 ** stage
            for i in range(count):
                layers.append(Bottleneck(inplanes, planes, 2 if stage and not i else 1))
                inplanes = planes * Bottleneck.expansion
        self.layers = nn.ModuleList(layers)
        self.head = PoolHead(inplanes, cfg.classes)

    loss = staticmethod(classification_loss)

    def example_batch(self, batch: int, seq_len: int | None, device: torch.device | str,
                      generator: torch.Generator | None = None):
        return random_images(batch, 3, self.cfg.image_size, self.cfg.classes, device, generator)
