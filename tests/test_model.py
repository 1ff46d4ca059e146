"""MoCo module: queue FIFO with ids, momentum update, no gradient to the key side, split BN, heads."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moco.model.backbones import SplitBatchNorm, build_backbone, convert_split_bn
from moco.model.builder import MoCo, momentum_schedule
from moco.model.loss import decorrelation


def tiny_backbone(width=8):
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
    )


def tiny_moco(**kw):
    kw.setdefault("head", "mlp")
    kw.setdefault("dim", 4)
    kw.setdefault("K", 10)
    return MoCo(tiny_backbone(), 8, **kw)


def batch(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 8, 8, generator=g), torch.randn(n, 3, 8, 8, generator=g)


def test_queue_fifo_and_ids_wrap_around():
    model = tiny_moco(K=10)
    assert model.queue.shape == (1, 4, 10) and (model.queue_ids == -1).all()
    torch.testing.assert_close(model.queue.norm(dim=1), torch.ones(1, 10))
    written = []
    for step in range(5):  # 5 batches of 4 into K=10: wraps twice, nothing dropped
        keys = F.normalize(torch.randn(4, 4), dim=1)
        ids = torch.arange(step * 4, step * 4 + 4)
        model.enqueue([keys], ids)
        written += list(zip(ids.tolist(), keys))
    assert int(model.queue_ptr) == 20 % 10
    # the queue holds exactly the last 10 keys written, each next to its id
    for key_id, key in written[-10:]:
        slot = (model.queue_ids[0] == key_id).nonzero().flatten()
        assert slot.numel() == 1
        torch.testing.assert_close(model.queue[0][:, slot[0]], key)
    assert sorted(model.queue_ids[0].tolist()) == list(range(10, 20))


def test_enqueue_rejects_batches_larger_than_queue():
    model = tiny_moco(K=4)
    with pytest.raises(ValueError, match="queue-size"):
        model.enqueue([torch.randn(5, 4)], torch.arange(5))


def test_momentum_update_formula():
    model = tiny_moco()
    with torch.no_grad():
        for p in model.backbone_momentum.parameters():
            p.normal_()
    q_before = [p.detach().clone() for p in model.backbone.parameters()]
    k_before = [p.detach().clone() for p in model.backbone_momentum.parameters()]
    m = 0.9
    model.momentum_update(m)
    for q, k0, k1 in zip(q_before, k_before, model.backbone_momentum.parameters()):
        torch.testing.assert_close(k1, m * k0 + (1 - m) * q, rtol=0, atol=1e-6)
    for q, q1 in zip(q_before, model.backbone.parameters()):
        assert torch.equal(q, q1)  # the query encoder is untouched


def test_momentum_schedule():
    assert momentum_schedule(5, 100, 0.999, cosine=False) == 0.999
    assert momentum_schedule(0, 100, 0.99, cosine=True) == pytest.approx(0.99)
    assert momentum_schedule(50, 100, 0.99, cosine=True) == pytest.approx(0.995)
    assert momentum_schedule(100, 100, 0.99, cosine=True) == pytest.approx(1.0)


@pytest.mark.parametrize("head,symmetric", [("linear", False), ("mlp", False), ("mlp", True), ("v3", True)])
def test_no_gradient_reaches_key_encoder_or_queue(head, symmetric):
    K = 0 if head == "v3" else 16
    model = tiny_moco(head=head, K=K, symmetric=symmetric, hidden=16, bn_splits=2 if head != "v3" else 1)
    x1, x2 = batch(4)
    loss, _ = model(x1, x2, 0.99, torch.arange(4))
    loss.backward()
    assert all(p.grad is None for p in model.backbone_momentum.parameters())
    assert all(p.grad is None for p in model.projector_momentum.parameters())
    assert all(not p.requires_grad for p in model.backbone_momentum.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.backbone.parameters())
    for name, buf in model.named_buffers():
        assert not buf.requires_grad, name


def test_forward_updates_key_encoder_before_keys_and_enqueues():
    model = tiny_moco(K=8)
    with torch.no_grad():
        for p in model.backbone.parameters():
            p.add_(0.5)  # make the query encoder differ from the key encoder
    expected = copy.deepcopy(model)
    expected.momentum_update(0.5)
    x1, x2 = batch(4)
    model(x1, x2, 0.5, torch.arange(100, 104))
    for a, b in zip(expected.backbone_momentum.parameters(), model.backbone_momentum.parameters()):
        torch.testing.assert_close(a, b)
    assert sorted(model.queue_ids[0, :4].tolist()) == [100, 101, 102, 103]
    assert int(model.queue_ptr) == 4


def test_symmetric_uses_one_queue_per_view():
    model = tiny_moco(K=8, symmetric=True)
    assert model.queue.shape == (2, 4, 8)
    x1, x2 = batch(4)
    model.eval()  # deterministic BN so keys can be recomputed
    model(x1, x2, 1.0, torch.arange(4))
    k2 = F.normalize(model.projector_momentum(model.backbone_momentum(x2)), dim=1)
    k1 = F.normalize(model.projector_momentum(model.backbone_momentum(x1)), dim=1)
    torch.testing.assert_close(model.queue[0][:, :4].t(), k2, atol=1e-5, rtol=0)  # view-2 keys for q1
    torch.testing.assert_close(model.queue[1][:, :4].t(), k1, atol=1e-5, rtol=0)  # view-1 keys for q2


def test_own_stale_keys_are_masked():
    model = tiny_moco(K=8)
    model.queue_ids[0, :3] = torch.tensor([7, 7, 1])
    mask = model._negatives_mask(torch.tensor([7, 2]), 0)
    assert mask[0].tolist() == [True, True] + [False] * 6
    assert not mask[1].any()
    assert tiny_moco(K=8, mask_own_keys=False)._negatives_mask(torch.tensor([7]), 0) is None


def test_split_batch_norm_matches_per_split_batch_norm():
    torch.manual_seed(0)
    s, c = 4, 3
    x = torch.randn(16, c, 5, 5)
    split = SplitBatchNorm(c, s)
    with torch.no_grad():
        split.weight.uniform_(0.5, 1.5)
        split.bias.uniform_(-0.5, 0.5)
    y = split(x)
    means, vars_ = [], []
    for i in range(s):
        ref = nn.BatchNorm2d(c)
        ref.load_state_dict({k: v for k, v in split.state_dict().items()}, strict=False)
        with torch.no_grad():
            ref.weight.copy_(split.weight)
            ref.bias.copy_(split.bias)
            ref.running_mean.zero_()
            ref.running_var.fill_(1)
        part = slice(i * 16 // s, (i + 1) * 16 // s)  # consecutive chunks
        torch.testing.assert_close(y[part], ref(x[part]), atol=1e-5, rtol=1e-5)
        means.append(ref.running_mean)
        vars_.append(ref.running_var)
    torch.testing.assert_close(split.running_mean, torch.stack(means).mean(0))
    torch.testing.assert_close(split.running_var, torch.stack(vars_).mean(0))
    split.eval()
    plain = nn.BatchNorm2d(c)
    plain.load_state_dict(split.state_dict())
    plain.eval()
    torch.testing.assert_close(split(x), plain(x))


def test_split_batch_norm_keeps_channels_last():
    """Same values and gradients in both layouts, and a channels_last input stays channels_last."""
    torch.manual_seed(0)
    x, g = torch.randn(8, 6, 4, 4), torch.randn(8, 6, 4, 4)
    outs = []
    for fmt in (torch.contiguous_format, torch.channels_last):
        split = SplitBatchNorm(6, 4)
        xi = x.clone().contiguous(memory_format=fmt).requires_grad_(True)
        y = split(xi)
        assert y.is_contiguous(memory_format=fmt)
        (y * g).sum().backward()
        outs.append((y.detach(), xi.grad, split.weight.grad, split.running_mean.clone()))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_convert_split_bn_keeps_state_dict_keys():
    net = tiny_backbone()
    keys = set(net.state_dict())
    converted = convert_split_bn(copy.deepcopy(net), 4)
    assert isinstance(converted[1], SplitBatchNorm) and set(converted.state_dict()) == keys


def test_v3_heads_shapes():
    model = tiny_moco(head="v3", K=0, hidden=16, dim=6)
    assert not hasattr(model, "queue")
    last = model.projector[-1]
    assert isinstance(last, nn.BatchNorm1d) and not last.affine
    assert isinstance(model.predictor[-1], nn.Linear)
    x1, x2 = batch(4)
    loss, stats = model(x1, x2, 0.99)
    assert loss.ndim == 0 and torch.isfinite(loss) and -1 <= stats["pos_sim"] <= 1


def test_v2_head_with_batch_norm_normalizes_its_hidden_layer_over_the_batch():
    plain, with_bn = tiny_moco(hidden=16), tiny_moco(hidden=16, head_bn=True)
    assert [type(m) for m in plain.projector] == [nn.Linear, nn.ReLU, nn.Linear]
    assert [type(m) for m in with_bn.projector] == [nn.Linear, nn.BatchNorm1d, nn.ReLU, nn.Linear]
    assert with_bn.projector[0].bias is None  # the BN's shift replaces it
    h = torch.randn(6, 8)  # N x D backbone features
    lin, bn, last = with_bn.projector[0], with_bn.projector[1], with_bn.projector[3]
    z = h @ lin.weight.t()  # N x hidden
    z = (z - z.mean(0)) / torch.sqrt(z.var(0, unbiased=False) + bn.eps) * bn.weight + bn.bias  # N x hidden
    torch.testing.assert_close(with_bn.projector(h), F.relu(z) @ last.weight.t() + last.bias)
    x1, x2 = batch(4)
    loss, _ = with_bn(x1, x2, 0.99, torch.arange(4))
    loss.backward()
    assert torch.isfinite(loss) and bn.weight.grad is not None and bn.weight.grad.abs().sum() > 0
    assert with_bn.projector_momentum[1].weight.grad is None


@pytest.mark.parametrize("arch,small_stem,width", [("resnet18", True, 512), ("resnet50", False, 2048)])
def test_torchvision_backbones(arch, small_stem, width):
    net, d = build_backbone(arch, small_stem=small_stem)
    assert d == width
    assert isinstance(net.fc, nn.Identity)
    if small_stem:
        assert net.conv1.kernel_size == (3, 3) and net.conv1.stride == (1, 1) and isinstance(net.maxpool, nn.Identity)
    net.eval()
    with torch.no_grad():
        assert net(torch.randn(2, 3, 32, 32)).shape == (2, width)


def test_timm_backbone_and_unknown_name():
    from moco.errors import UserError

    net, d = build_backbone("timm/resnet18", small_stem=True)
    assert type(net).__module__.startswith("timm") and d == 512
    net.eval()
    with torch.no_grad():
        assert net(torch.randn(2, 3, 32, 32)).shape == (2, d)
    with pytest.raises(UserError, match="unknown backbone"):
        build_backbone("resnet_does_not_exist")


def test_small_stem_refused_for_models_without_one():
    from moco.errors import UserError

    with pytest.raises(UserError, match="small-stem"):
        build_backbone("resnet10t", small_stem=True)  # timm deep stem: conv1 is a Sequential


@pytest.mark.parametrize(("head", "symmetric"), [("mlp", False), ("mlp", True), ("v3", True)])
def test_decorrelation_weight_adds_the_query_backbones_redundancy_to_the_loss(head, symmetric):
    K = 0 if head == "v3" else 16
    plain = tiny_moco(head=head, K=K, symmetric=symmetric, hidden=16)
    weighted = copy.deepcopy(plain)
    weighted.decorrelation = 0.5
    reference = copy.deepcopy(plain)  # the backbone before the step: the redundancy its features have
    x1, x2 = batch(6)
    views = [x1, x2] if symmetric else [x1]
    expected = torch.stack([decorrelation(reference.backbone(x)) for x in views]).mean()
    loss0, stats0 = plain(x1, x2, 0.99, torch.arange(6))
    loss1, stats1 = weighted(x1, x2, 0.99, torch.arange(6))
    assert "decorrelation" not in stats0
    torch.testing.assert_close(stats1["decorrelation"], expected.detach())
    torch.testing.assert_close(loss1, loss0 + 0.5 * expected)
    loss1.backward()  # the term reaches the query backbone only
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in weighted.backbone.parameters())
    assert all(p.grad is None for p in weighted.backbone_momentum.parameters())
