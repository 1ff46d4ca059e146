"""Our ResNet family against torchvision's, the reference the official MoCo code builds: the same modules and
state-dict keys for every name, the same weights from the same seed (with and without zero-init residuals), and the
same outputs in training and eval mode."""

from __future__ import annotations

import pytest
import torch
import torchvision.models.resnet as tvr

from moco.model.resnet import RESNETS, resnet


@pytest.mark.parametrize("name", sorted(RESNETS))
def test_every_name_has_torchvisions_modules_and_keys(name):
    with torch.device("meta"):
        ours, theirs = resnet(name), getattr(tvr, name)(weights=None)
    assert [(k, v.shape) for k, v in ours.state_dict().items()] == [
        (k, v.shape) for k, v in theirs.state_dict().items()]
    assert [type(m).__name__ for m in ours.modules()] == [type(m).__name__ for m in theirs.modules()]


@pytest.mark.parametrize("name", ["resnet18", "resnet50", "resnext50_32x4d"])
@pytest.mark.parametrize("zero_init_residual", [False, True])
def test_the_same_seed_draws_the_same_weights_and_outputs(name, zero_init_residual):
    torch.manual_seed(3)
    ours = resnet(name, zero_init_residual=zero_init_residual)
    torch.manual_seed(3)
    theirs = getattr(tvr, name)(weights=None, zero_init_residual=zero_init_residual)
    mine, ref = ours.state_dict(), theirs.state_dict()
    assert all(torch.equal(mine[k], ref[k]) for k in ref)
    x = torch.randn(2, 3, 64, 64)  # N x 3 x H x W
    for train in (True, False):
        ours.train(train)
        theirs.train(train)
        with torch.no_grad():
            assert torch.allclose(ours(x), theirs(x), atol=1e-5, rtol=1e-5)
    assert all(torch.equal(ours.state_dict()[k], theirs.state_dict()[k]) for k in ref)  # running stats too


def test_a_torchvision_checkpoint_loads_as_it_is():
    theirs = tvr.wide_resnet50_2(weights=None).eval()
    ours = resnet("wide_resnet50_2").eval()
    ours.load_state_dict(theirs.state_dict(), strict=True)
    x = torch.randn(1, 3, 48, 48)
    with torch.no_grad():
        assert torch.allclose(ours(x), theirs(x), atol=1e-5)
