"""get_batch sampling and load_tokens validation."""

import numpy as np
import pytest
import torch

from scratchlm import get_batch, load_tokens
from scratchlm.data import tokens as data
from scratchlm.errors import ScratchlmError


def test_targets_are_the_inputs_shifted_by_one():
    dataset = np.arange(1000, dtype=np.uint16)
    inputs, targets = get_batch(dataset, 16, 12, "cpu", np.random.default_rng(0))
    assert inputs.shape == targets.shape == (16, 12)
    assert inputs.dtype == targets.dtype == torch.int64
    # each row is a window of consecutive ids starting at its start position
    starts = inputs[:, 0]
    torch.testing.assert_close(inputs, starts[:, None] + torch.arange(12))
    torch.testing.assert_close(targets, inputs + 1)


def test_start_indices_are_uniform_over_every_valid_start():
    n, context = 20, 5  # valid starts 0 ..= 14: 15 of them
    dataset = np.arange(n, dtype=np.int64)
    g = np.random.default_rng(123)
    counts = np.zeros(n, dtype=np.int64)
    draws = 0
    for _ in range(300):
        inputs, _ = get_batch(dataset, 50, context, "cpu", g)
        np.add.at(counts, inputs[:, 0].numpy(), 1)
        draws += 50
    valid = n - context
    assert counts[valid:].sum() == 0
    assert (counts[:valid] > 0).all()  # both ends included: 0 and len - context - 1
    expected = draws / valid
    chi_square = ((counts[:valid] - expected) ** 2 / expected).sum()
    assert chi_square < 36.1  # 14 degrees of freedom, p = 0.001


def test_without_a_generator_numpy_global_seed_makes_it_reproducible():
    dataset = np.arange(500, dtype=np.uint16)
    np.random.seed(7)
    first = get_batch(dataset, 4, 8, "cpu")
    np.random.seed(7)
    second = get_batch(dataset, 4, 8, "cpu")
    assert torch.equal(first[0], second[0])


def test_same_generator_seed_same_batches():
    dataset = np.arange(500, dtype=np.uint16)
    a = get_batch(dataset, 4, 8, "cpu", np.random.default_rng(3))
    b = get_batch(dataset, 4, 8, "cpu", np.random.default_rng(3))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("device", ["cuda:99", "not-a-device"])
def test_invalid_device_raises(device):
    with pytest.raises((RuntimeError, AssertionError)):
        get_batch(np.arange(100), 2, 4, device)


def test_dataset_too_short_for_the_context():
    with pytest.raises(ScratchlmError, match="too short"):
        get_batch(np.arange(8), 2, 8, "cpu")


def test_memmapped_file_round_trip(tmp_path):
    path = tmp_path / "tokens.npy"
    ids = np.random.default_rng(0).integers(0, 300, 2000).astype(np.uint16)
    np.save(path, ids)
    tokens = load_tokens(path, vocab_size=300, context_length=16)
    assert isinstance(tokens, np.memmap)
    inputs, targets = get_batch(tokens, 3, 16, "cpu", np.random.default_rng(0))
    windows = np.lib.stride_tricks.sliding_window_view(ids, 17)  # brute force: every window of the file
    for row_in, row_out in zip(inputs.numpy(), targets.numpy(), strict=True):
        row = np.concatenate([row_in, row_out[-1:]])
        assert (windows == row).all(axis=1).any()
        assert (row_out == row[1:]).all()


def save(tmp_path, array, name="tokens.npy"):
    path = tmp_path / name
    np.save(path, array)
    return path


def test_missing_file(tmp_path):
    with pytest.raises(ScratchlmError, match=r"nothere\.npy not found"):
        load_tokens(tmp_path / "nothere.npy", 100, 8)


def test_not_an_npy_file(tmp_path):
    path = tmp_path / "text.npy"
    path.write_text("hello")
    with pytest.raises(ScratchlmError, match=r"text\.npy is not a \.npy file; expected the \.npy token ids"):
        load_tokens(path, 100, 8)


def test_wrong_dtype(tmp_path):
    path = save(tmp_path, np.zeros(100, dtype=np.float32))
    with pytest.raises(ScratchlmError, match=r"tokens\.npy holds float32"):
        load_tokens(path, 100, 8)


def test_wrong_shape(tmp_path):
    path = save(tmp_path, np.zeros((10, 10), dtype=np.uint16))
    with pytest.raises(ScratchlmError, match=r"shape \(10, 10\)"):
        load_tokens(path, 100, 8)


def test_too_short(tmp_path):
    path = save(tmp_path, np.zeros(8, dtype=np.uint16))
    with pytest.raises(ScratchlmError, match=r"tokens\.npy has 8 tokens; context_length 8 needs at least 9"):
        load_tokens(path, 100, 8)


def test_id_out_of_vocabulary_is_found_in_a_later_chunk(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "VALIDATION_CHUNK", 64)
    ids = np.full(1000, 5, dtype=np.uint16)
    ids[777] = 100
    path = save(tmp_path, ids)
    with pytest.raises(ScratchlmError, match=r"tokens\.npy has id 100 at position 777; .* 0\.\.99"):
        load_tokens(path, 100, 8)
    assert len(load_tokens(path, 101, 8)) == 1000


def test_negative_ids_are_rejected(tmp_path):
    ids = np.zeros(50, dtype=np.int32)
    ids[3] = -1
    with pytest.raises(ScratchlmError, match="id -1 at position 3"):
        load_tokens(save(tmp_path, ids), 100, 8)
