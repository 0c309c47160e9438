"""Tensors from Python: creation, dtypes, NumPy and DLPack interchange (zero-copy, shown by
writes through the shared memory), autograd against PyTorch, grad mode, and errors."""

import numpy as np
import pytest
import torch

import kuai

DTYPES = [
    (kuai.float32, np.float32, torch.float32),
    (kuai.float16, np.float16, torch.float16),
    (kuai.int32, np.int32, torch.int32),
    (kuai.int64, np.int64, torch.int64),
    (kuai.uint8, np.uint8, torch.uint8),
]


def test_tensor_creation_and_properties():
    t = kuai.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    assert t.shape == (2, 3) and t.dtype == kuai.float32 and t.stride() == (3, 1)
    assert t.device == "cpu" and str(t.device) == "cpu" and t.ndim == 2 and t.numel() == 6
    assert kuai.tensor([1, 2]).dtype == kuai.int64  # Python ints: int64, as torch
    assert kuai.tensor([1, 2], dtype=kuai.int32).dtype == kuai.int32
    assert kuai.zeros(2, 3).tolist() == [[0.0] * 3] * 2
    assert kuai.ones((4,), dtype=kuai.bfloat16).float().tolist() == [1.0] * 4
    assert kuai.arange(5).tolist() == [0, 1, 2, 3, 4]
    assert t.transpose(0, 1).stride() == (1, 3) and not t.transpose(0, 1).is_contiguous()
    assert t[1].tolist() == [4.0, 5.0, 6.0] and t[:, 1:].tolist() == [[2.0, 3.0], [5.0, 6.0]]
    assert t.sum().item() == 21.0 and t.mean(dim=1).tolist() == [2.0, 5.0]


@pytest.mark.parametrize("kd,nd,td", DTYPES)
def test_numpy_round_trip_shares_memory(kd, nd, td):
    a = np.arange(12, dtype=nd).reshape(3, 4)
    t = kuai.from_numpy(a)
    assert t.dtype == kd and t.shape == (3, 4) and t.stride() == (4, 1)
    a[1, 2] = 7  # a write through NumPy is seen by kuai: the same bytes
    assert t[1, 2].item() == 7
    back = t.numpy()
    assert back.dtype == nd and np.shares_memory(back, a)
    back[0, 0] = 9
    assert a[0, 0] == 9


def test_numpy_strided_views_and_lifetime():
    a = np.arange(24, dtype=np.float32).reshape(4, 6)[:, 1:5]  # not contiguous
    t = kuai.from_numpy(a)
    assert t.stride() == (6, 1) and not t.is_contiguous()
    assert (t.numpy() == a).all() and np.shares_memory(t.numpy(), a)
    del a  # the tensor keeps the array alive
    assert t.tolist()[3] == [19.0, 20.0, 21.0, 22.0]
    with pytest.raises(ValueError, match="negative"):
        kuai.from_numpy(np.arange(4, dtype=np.float32)[::-1])
    with pytest.raises(TypeError, match="float64"):
        kuai.from_numpy(np.zeros(3))


@pytest.mark.parametrize("kd,nd,td", DTYPES + [(kuai.bfloat16, None, torch.bfloat16)])
def test_dlpack_both_ways_shares_memory(kd, nd, td):
    x = torch.arange(12).reshape(3, 4).to(td)
    k = kuai.from_dlpack(x)
    assert k.dtype == kd and k.shape == (3, 4) and k.stride() == (4, 1)
    assert k.data_ptr() == x.data_ptr()
    x[0, 1] = 5  # a write through torch is seen by kuai
    assert k[0, 1].float().item() == 5
    y = torch.from_dlpack(k)
    assert y.dtype == td and y.data_ptr() == x.data_ptr() and tuple(y.shape) == (3, 4)
    y[2, 3] = 11
    assert x[2, 3].item() == 11
    assert k.__dlpack_device__() == (1, 0)


def test_dlpack_of_a_kuai_view_and_lifetime():
    t = kuai.arange(20).reshape(4, 5).transpose(0, 1)
    y = torch.from_dlpack(t)
    assert tuple(y.stride()) == (1, 5) and y.tolist() == np.arange(20).reshape(4, 5).T.tolist()
    del t  # torch keeps kuai's bytes alive
    assert y[4, 3].item() == 19
    x = torch.ones(3)
    k = kuai.from_dlpack(x)
    del x
    assert k.tolist() == [1.0, 1.0, 1.0]


def test_autograd_matches_torch():
    rng = np.random.default_rng(0)
    a_np, b_np = rng.standard_normal((3, 4), dtype=np.float32), rng.standard_normal((4, 5), dtype=np.float32)
    a, b = kuai.tensor(a_np, requires_grad=True), kuai.tensor(b_np, requires_grad=True)
    out = (kuai.softmax(a @ b * 0.5 + 1.0, dim=-1) - b.sum(dim=0)).mean()
    out.backward()
    ta, tb = torch.tensor(a_np, requires_grad=True), torch.tensor(b_np, requires_grad=True)
    tout = (torch.softmax(ta @ tb * 0.5 + 1.0, dim=-1) - tb.sum(dim=0)).mean()
    tout.backward()
    assert abs(out.item() - tout.item()) < 1e-6
    np.testing.assert_allclose(a.grad.numpy(), ta.grad.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(b.grad.numpy(), tb.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_cross_entropy_and_layers_match_torch():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((6, 10), dtype=np.float32)
    target = np.array([1, 0, 9, 3, 3, 7], dtype=np.int32)
    k = kuai.nn.functional.cross_entropy(kuai.tensor(logits), kuai.tensor(target))
    t = torch.nn.functional.cross_entropy(torch.tensor(logits), torch.tensor(target).long())
    assert abs(k.item() - t.item()) < 1e-6
    x = rng.standard_normal((2, 3, 8), dtype=np.float32)
    w, bias = rng.standard_normal(8, dtype=np.float32), rng.standard_normal(8, dtype=np.float32)
    kl = kuai.nn.functional.layer_norm(kuai.tensor(x), 8, kuai.tensor(w), kuai.tensor(bias))
    tl = torch.nn.functional.layer_norm(torch.tensor(x), (8,), torch.tensor(w), torch.tensor(bias))
    np.testing.assert_allclose(kl.numpy(), tl.numpy(), rtol=1e-5, atol=1e-5)


def test_no_grad_and_grad_mode():
    a = kuai.ones(3, requires_grad=True)
    with kuai.no_grad():
        assert not kuai.is_grad_enabled()
        assert not (a * 2.0).requires_grad
    assert kuai.is_grad_enabled() and (a * 2.0).requires_grad

    @kuai.no_grad()
    def f(x):
        return x + 1.0

    assert not f(a).requires_grad and kuai.is_grad_enabled()


def test_errors_arrive_as_python_exceptions_with_the_engine_message():
    a, b = kuai.zeros(2, 3), kuai.zeros(2, 3)
    with pytest.raises(ValueError, match=r"matmul: cannot multiply \(2, 3\) by \(2, 3\)"):
        a @ b
    with pytest.raises(ValueError, match="add"):
        kuai.zeros(2, 3) + kuai.zeros(4, 5)
    with pytest.raises(IndexError):
        a[5]
    with pytest.raises(TypeError, match="bfloat16"):
        kuai.zeros(2, dtype=kuai.bfloat16).numpy()
    with pytest.raises(RuntimeError, match="nonexistent"):
        kuai.data.TokenFile("/nonexistent/tokens.bin")
