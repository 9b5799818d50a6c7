"""Built-in datasets (from data shipped in packages) and the adapters for the user's data."""

import numpy as np
import pytest
import torch
from helpers import Sentences, bag_of_words, pad_to_longest
from workbench.datasets import builders, ensure_built, load

import workbench as wb
from workbench.data import (
    BUILTIN_DATA,
    DataSource,
    builtin_spec,
    endless_batches,
    list_datasets,
    resolve_data,
)


@pytest.mark.parametrize("name", ["digits", "textures", "text"])
def test_builtin_dataset_builds_and_loads_without_pickle(name):
    path = ensure_built(name)
    arrays = load(path)  # np.load(allow_pickle=False) inside
    spec = builtin_spec(name)
    if name == "text":
        assert arrays["corpus"].dtype == np.uint8 and len(arrays["corpus"]) == 2_000_000
        assert b"def " in arrays["corpus"][:200_000].tobytes()  # it really is Python source
    else:
        assert arrays["inputs"].shape[1:] == spec.shape
        assert sorted(set(arrays["targets"].tolist())) == list(range(spec.num_classes))


def test_textures_are_six_real_photo_classes():
    arrays = load(ensure_built("textures"))
    assert list(arrays["classes"]) == ["brick", "grass", "gravel", "moon", "cell", "coins"]
    means = [arrays["inputs"][arrays["targets"] == k].std() for k in range(6)]
    assert all(m > 5 for m in means), "each class must have texture, not flat crops"


def test_builders_are_deterministic(tmp_path):
    first, second = builders()["textures"].build(), builders()["textures"].build()
    assert np.array_equal(first["inputs"], second["inputs"])


@pytest.mark.parametrize(
    "model,data,kind",
    [
        ("mlp", "digits", "image"),
        ("resnet-mini", "textures", "image"),
        ("gpt-mini", "text", "tokens"),
        ("gpt-mini", "synthetic", "tokens"),
        ("resnet-mini", "synthetic", "image"),
    ],
)
def test_builtin_batches_have_the_model_shapes(model, data, kind):
    source = resolve_data(data, model)
    inputs, targets = next(endless_batches(source, 8, 0, {}))
    assert source.spec.kind == kind and inputs.shape == (8, *source.spec.shape)
    assert targets.dtype == torch.int64
    if kind == "tokens":
        assert torch.equal(inputs[:, 1:], targets[:, :-1]), "targets are the inputs shifted by one"


def test_every_arm_sees_the_same_batches():
    source = resolve_data("textures", "resnet-mini")
    a = next(endless_batches(source, 16, 7, {}))
    b = next(endless_batches(source, 16, 7, {"num_workers": 1}))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_batches_continue_past_the_end_of_an_epoch():
    source = resolve_data("digits", "mlp")
    stream = endless_batches(source, 512, 0, {})
    assert len([next(stream) for _ in range(10)]) == 10  # 1,797 samples = 3 batches per epoch


def test_user_dataset_list_of_batches_and_callable():
    dataset = torch.utils.data.TensorDataset(torch.randn(20, 3), torch.randint(0, 2, (20,)))
    source = resolve_data(dataset, lambda: torch.nn.Linear(3, 2))
    assert source.is_dataset and next(endless_batches(source, 4, 0, {}))[0].shape == (4, 3)

    batches = [(torch.randn(5, 3), torch.zeros(5, dtype=torch.long))] * 2
    source = resolve_data(batches, lambda: torch.nn.Linear(3, 2))
    assert not source.is_dataset
    stream = endless_batches(source, 999, 0, {})
    assert [next(stream)[0].shape[0] for _ in range(5)] == [5] * 5  # cycled; batch_size does not apply

    def fresh_generator():
        return ((torch.randn(2, 3), torch.zeros(2, dtype=torch.long)) for _ in range(3))

    # A factory of one-pass generators is called again for each pass (it was once refused, with a
    # message asking for "a callable that returns a fresh iterable": what it is).
    calls = []
    source = resolve_data(lambda: calls.append(1) or fresh_generator(), lambda: torch.nn.Linear(3, 2))
    calls.clear()  # resolve_data may have looked at one
    stream = endless_batches(source, 2, 0, {})
    assert len([next(stream) for _ in range(7)]) == 7 and len(calls) == 3  # passes of 3, 3 and 1
    # A generator given as it is can be read once only (resolve_data refuses it before this).
    source = DataSource(label="generator", user=fresh_generator(), is_dataset=False)
    stream = endless_batches(source, 2, 0, {})
    with pytest.raises(ValueError, match="ran out after 3 batches and cannot be replayed"):
        for _ in range(4):
            next(stream)


class _Stream(torch.utils.data.IterableDataset):
    """Samples in the stream's own order: a DataLoader may batch it, but not shuffle or sample it."""

    def __iter__(self):
        for index in range(20):
            yield torch.full((3,), float(index)), index % 2


def test_an_iterable_dataset_is_batched_in_its_own_order_and_dealt_out_to_ranks():
    source = resolve_data(_Stream(), lambda: torch.nn.Linear(3, 2))
    stream = endless_batches(source, 4, 0, {})
    firsts = [int(next(stream)[0][0, 0]) for _ in range(6)]
    assert firsts == [0, 4, 8, 12, 16, 0]  # in order, a new pass after 5 batches
    rank_1 = endless_batches(source, 4, 0, {}, rank=1, world_size=2)
    assert [int(next(rank_1)[0][0, 0]) for _ in range(3)] == [4, 12, 0]  # batches 1, 3 and 5
    # Its length shows only as it is read: a stream shorter than one batch is told so.
    with pytest.raises(ValueError, match="yielded no full batch of batch_size=32 samples; pass a smaller"):
        next(endless_batches(source, 32, 0, {}))


class _SharedStream(torch.utils.data.IterableDataset):
    """Each DataLoader worker yields only its share, as PyTorch's IterableDataset docs show."""

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        first, step = (info.id, info.num_workers) if info is not None else (0, 1)
        for index in range(first, 20, step):
            yield torch.full((3,), float(index)), index % 2


class _RandomStream(torch.utils.data.IterableDataset):
    """Draws from the global random state, which every worker seeds anew: no two workers repeat."""

    def __iter__(self):
        for _ in range(20):
            yield torch.randn(3), 0


class _ShuffledStream(torch.utils.data.IterableDataset):
    """The whole stream in every worker, shuffled by the global random state: each worker reads
    all 20 samples, in its own order."""

    def __iter__(self):
        for index in torch.randperm(20).tolist():
            yield torch.full((3,), float(index)), index % 2


class _OwnGeneratorStream(torch.utils.data.IterableDataset):
    """Shuffled by a generator of its own, made once: every worker's copy holds it in one state."""

    def __init__(self):
        self.generator = torch.Generator().manual_seed(0)

    def __iter__(self):
        for index in torch.randperm(20, generator=self.generator).tolist():
            yield torch.full((3,), float(index)), index % 2


def test_an_iterable_dataset_that_gives_every_worker_the_whole_stream_is_told_apart():
    model = lambda: torch.nn.Linear(3, 2)  # noqa: E731
    assert resolve_data(_Stream(), model).whole_stream_per_worker
    assert resolve_data(_Stream, model).whole_stream_per_worker  # a factory's stream
    assert not resolve_data(_SharedStream(), model).whole_stream_per_worker
    assert not resolve_data(_RandomStream(), model).whole_stream_per_worker
    # Shuffled, a whole stream was taken for a shared one: two workers began on different samples
    # (the probe's second ask went on from the first's random state), and trained on each twice.
    before = torch.get_rng_state()
    assert resolve_data(_ShuffledStream(), model).whole_stream_per_worker
    assert resolve_data(_OwnGeneratorStream(), model).whole_stream_per_worker
    assert torch.equal(torch.get_rng_state(), before)  # the probe leaves the random state as it was
    assert not resolve_data(torch.utils.data.TensorDataset(torch.zeros(4, 3)), model).whole_stream_per_worker
    assert torch.utils.data.get_worker_info() is None  # the probe left torch's worker state as it was
    # What the check is for: with two workers, the whole stream arrives twice; a shared one, once.
    for stream, copies in ((_Stream(), 2), (_SharedStream(), 1)):
        loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=2)
        seen = sorted(int(inputs[0]) for inputs, _ in loader)
        assert seen == sorted(list(range(20)) * copies)


def test_dataloader_workers_are_unavailable_for_a_stream_each_worker_would_read_whole():
    sweep = {"dataloader": {"num_workers": [1, 2]}}
    for stream, refused in ((_Stream(), True), (_SharedStream(), False)):
        table = wb.plan(
            model=lambda: torch.nn.Linear(3, 2), data=stream, techniques=sweep, device="cpu", batch_size=4
        )
        reasons = table.set_index("name").unavailable
        assert reasons["dataloader[num_workers=1]"] == ""  # one worker reads the stream once
        if refused:
            assert (
                "gives every worker the whole stream, so with num_workers=2 each sample would arrive 2 times"
                in (reasons["dataloader[num_workers=2]"])
            )
        else:
            assert reasons["dataloader[num_workers=2]"] == ""


class _ShufflingStream(torch.utils.data.IterableDataset):
    """A stream that shuffles with a generator of its own, made once: its state moves as it is read."""

    def __init__(self):
        self.inputs, self.targets = torch.randn(96, 3), torch.arange(96) % 2
        self.rng = torch.Generator().manual_seed(1)

    def __iter__(self):
        for index in torch.randperm(96, generator=self.rng):
            yield self.inputs[index], self.targets[index]


def test_each_arm_in_a_block_reads_its_own_copy_of_a_stateful_loader_or_stream():
    """Arms that shared one DataLoader (its shuffling generator) or one stream each advanced it, so
    they trained on different batches: the control's loss differed from the baseline's."""
    from workbench.data import arms_own

    dataset = torch.utils.data.TensorDataset(torch.randn(96, 3), torch.arange(96) % 2)
    shuffled = torch.utils.data.DataLoader(
        dataset, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    copied = arms_own(shuffled)
    assert copied.dataset is dataset and copied.generator is not shuffled.generator  # samples shared
    stream = _ShufflingStream()
    assert arms_own(stream).inputs is stream.inputs and arms_own(stream).rng is not stream.rng
    assert arms_own(dataset) is dataset  # workbench makes each arm's DataLoader of it
    for data in (shuffled, stream):
        table = wb.ablate(
            model=lambda: torch.nn.Linear(3, 2), data=data, techniques={}, steps=12, warmup=1, blocks=1,
            batch_size=8, control=True, out=False, progress=False,
        ).table.set_index("arm")  # fmt: skip
        assert table.final_loss["baseline (control)"] == table.final_loss["baseline"], type(data).__name__


def test_a_dataloader_that_keeps_its_workers_is_read_in_this_process_and_still_sent_to_the_arms():
    """workbench reads the first batch here; a DataLoader with persistent_workers then kept its
    workers here and an iterator that cannot be pickled, and every arm's launch failed."""
    import multiprocessing
    import pickle

    dataset = torch.utils.data.TensorDataset(torch.randn(64, 3), torch.randint(0, 2, (64,)))
    loader = torch.utils.data.DataLoader(dataset, batch_size=8, num_workers=1, persistent_workers=True)
    assert not wb.plan(model=lambda: torch.nn.Linear(3, 2), data=loader, device="cpu").empty
    pickle.dumps(loader)  # what sending it to an arm's process does
    assert multiprocessing.active_children() == []


def test_bad_batches_and_small_datasets_are_explained():
    bad = DataSource(label="bad", user=[torch.zeros(3)], is_dataset=False)
    with pytest.raises(ValueError, match=r"each batch must be an \(inputs, targets\) pair"):
        next(endless_batches(bad, 2, 0, {}))
    # Samples given where batches go: a list of (input, target) pairs counted its features as
    # samples; tensors (data=(X, y)) were read one row at a time. Each is told what to pass.
    inputs, targets = torch.randn(6, 8), torch.randn(6)
    for data, why in ((list(zip(inputs, targets, strict=True)), "this is one sample, not a batch"),
                      ((inputs, targets), "got a Tensor")):  # fmt: skip
        with pytest.raises(ValueError, match=why + r".*read as ready-made batches.*TensorDataset"):
            wb.plan(model=lambda: torch.nn.Linear(8, 1), data=data, loss_fn=torch.nn.functional.mse_loss)
    # A Dataset's samples, batched by workbench, were told about lists of ready-made batches.
    model = lambda: torch.nn.Linear(8, 1)  # noqa: E731
    triples = torch.utils.data.TensorDataset(inputs, targets, targets)
    with pytest.raises(
        ValueError, match=r"got a list of 3 items\. workbench batches a Dataset's samples.*__getitem__"
    ):
        wb.plan(model=model, data=triples, batch_size=2, loss_fn=torch.nn.functional.mse_loss)
    pairs = torch.utils.data.TensorDataset(inputs, targets)
    with pytest.raises(ValueError, match=r"got a list of 3 items\. This batch is what your collate_fn"):
        wb.plan(model=model, data=pairs, batch_size=3, collate_fn=lambda samples: samples)
    with pytest.raises(ValueError, match=r"targets must be one tensor.*got tuple\. This batch is what your"):
        wb.plan(model=model, data=pairs, batch_size=2, collate_fn=lambda samples: samples)
    small = torch.utils.data.TensorDataset(torch.zeros(3, 2), torch.zeros(3))
    with pytest.raises(ValueError, match="data 'small' has 3 samples, fewer than batch_size=8"):
        next(endless_batches(DataSource(label="small", user=small), 8, 0, {}))
    with pytest.raises(ValueError, match="returned int"):
        resolve_data(lambda: 3, lambda: torch.nn.Linear(1, 1))


def test_samples_of_different_shapes_are_told_how_to_be_batched():
    class VariableLength(torch.utils.data.Dataset):
        def __len__(self):
            return 16

        def __getitem__(self, index):
            return torch.zeros(5 + index % 3), index % 2

    with pytest.raises(
        ValueError, match=r"samples differ in shape.*collate_fn=.*\(stack expects each tensor"
    ):
        wb.plan(model=lambda: torch.nn.EmbeddingBag(8, 2), data=VariableLength(), batch_size=4)


def test_collate_fn_batches_the_users_samples_in_every_dataloader_workbench_makes(tmp_path):
    """Without collate_fn, samples of different lengths needed a DataLoader of the user's own,
    which made the dataloader technique unavailable. With it, workers batch them too."""
    results = wb.ablate(
        bag_of_words, Sentences(), techniques={"dataloader": {"num_workers": 1}}, collate_fn=pad_to_longest,
        steps=6, warmup=1, blocks=1, batch_size=4, out=tmp_path / "r", progress=False, loader_arms=False,
    )  # fmt: skip
    table = results.table.set_index("arm")
    assert (table.status == "ok").all() and table.final_loss.notna().all()
    assert "dataloader" in table.index  # the workers ran the collate_fn too
    assert results.record["config"]["collate_fn"] == "pad_to_longest"
    # resuming with another collate_fn is another job: refused, naming what differs
    with pytest.raises(ValueError, match="differs in: .*collate"):
        wb.ablate(
            bag_of_words, Sentences(), techniques={}, collate_fn=lambda samples: pad_to_longest(samples[::-1]),
            steps=6, warmup=1, blocks=1, batch_size=4, out=tmp_path / "r", progress=False,
        )  # fmt: skip


def test_collate_fn_is_refused_where_workbench_does_not_batch_samples():
    sentences, model = Sentences(), bag_of_words
    with pytest.raises(ValueError, match="collate_fn must be a function .* got 3"):
        wb.plan(model, sentences, collate_fn=3)
    batches = [pad_to_longest([sentences[i] for i in range(4)])]
    with pytest.raises(ValueError, match="ready-made batches .* pass the Dataset itself with collate_fn"):
        wb.plan(model, batches, collate_fn=pad_to_longest)
    with pytest.raises(ValueError, match="'digits' is built-in data, which workbench batches itself"):
        wb.plan("mlp", collate_fn=pad_to_longest)


def test_an_error_in_the_users_collate_fn_is_its_own_not_the_default_collates():
    def stacks_unequal(samples):
        return torch.stack([tokens for tokens, _ in samples]), torch.zeros(len(samples), dtype=torch.long)

    with pytest.raises(
        ValueError, match="fails, as every arm's would: RuntimeError: stack expects each tensor"
    ) as caught:
        wb.plan(bag_of_words, Sentences(), collate_fn=stacks_unequal, batch_size=4)
    assert "default collate" not in str(caught.value)


def test_list_datasets():
    table = list_datasets()
    assert list(table.name) == list(BUILTIN_DATA)


def test_persistent_workers_keep_the_baselines_order_after_the_first_epoch():
    """The order's generator also gave each new DataLoader iterator its workers' base seed, a draw
    that persistent workers skip from the second epoch on: the arm trained on other batches."""

    class Indexed(torch.utils.data.Dataset):
        def __len__(self):
            return 16

        def __getitem__(self, index):
            return torch.zeros(3), index

    source = resolve_data(Indexed(), lambda: torch.nn.Linear(3, 2))

    def order(options):
        batches = endless_batches(source, 4, 0, options)
        return [next(batches)[1].tolist() for _ in range(12)]  # three epochs

    assert order({"num_workers": 1, "persistent_workers": True}) == order({})


def test_a_dataloader_workers_error_is_told_by_its_own_last_line():
    """Wrapped by the DataLoader, its traceback in the text, the error was cut at 400 characters
    to the wrapper and its first frames: the sample's own words were lost."""
    from workbench.data import loader_worker_error
    from workbench.worker import one_line

    class Faulty(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, index):
            raise KeyError(f"bad sample {index}")

    with pytest.raises(Exception) as caught:
        next(iter(torch.utils.data.DataLoader(Faulty(), batch_size=2, num_workers=1)))
    assert one_line(caught.value) == "KeyError: 'bad sample 0' (in DataLoader worker process 0)"
    assert loader_worker_error(ValueError("a plain error")) is None
    assert one_line(ValueError("a  plain\nerror")) == "ValueError: a plain error"


def test_a_dataset_without_a_length_or_whose_samples_fail_is_said_in_one_line():
    """Each came out as a bare exception: "object of type 'NoLen' has no len()", "KeyError: 53"."""

    class NoLen(torch.utils.data.Dataset):
        def __getitem__(self, index):
            return torch.zeros(4), 0

    class Faulty(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, index):
            raise KeyError(f"bad sample {index}")

    model = lambda: torch.nn.Linear(4, 2)  # noqa: E731
    with pytest.raises(ValueError, match=r"NoLen is read by index \(__getitem__\) but has no __len__"):
        wb.plan(model=model, data=NoLen(), device="cpu")
    with pytest.raises(ValueError, match=r"NoLen is read by index"):
        wb.plan(model=model, data=NoLen, device="cpu")  # a factory's Dataset
    with pytest.raises(
        ValueError, match=r"first batch of data 'Faulty' fails, as every arm's would: KeyError: 'bad"
    ):
        wb.plan(model=model, data=Faulty(), device="cpu")


def test_a_stream_shared_among_more_workers_than_it_can_fill_says_so():
    """Each worker batches only its share: 20 samples over 2 workers leave 10 each, under a batch
    of 12, and the message asked only for a smaller batch or more data."""
    source = resolve_data(_SharedStream(), lambda: torch.nn.Linear(3, 2))
    with pytest.raises(ValueError, match=r"no full batch.*or fewer DataLoader workers \(each of the 2"):
        next(endless_batches(source, 12, 0, {"num_workers": 2}))


def _loader_with_workers():
    dataset = torch.utils.data.TensorDataset(torch.randn(64, 3), torch.randint(0, 2, (64,)))
    return torch.utils.data.DataLoader(dataset, batch_size=8, num_workers=1)


def test_a_dataloader_given_as_data_with_workers_is_said_to_be_left_out_of_the_cpu_figure():
    """Its workers are processes of their own, which the arm's CPU figure leaves out. No note said so."""
    from helpers import arm_result, block_spec

    from workbench.worker import run_block

    spec = block_spec(lambda: torch.nn.Linear(3, 2), data=_loader_with_workers(), batch_size=8)
    notes = arm_result(run_block(spec))["notes"]
    assert any("cpu_util_pct leaves out the DataLoader's 1 worker process(es)" in note for note in notes), (
        notes
    )


@pytest.mark.parametrize("given", ["loader", "factory"])
def test_a_dataloader_given_as_data_with_workers_puts_every_arm_in_a_process_of_its_own(given):
    """Each arm's copy of the loader has its own workers, which go on loading ahead while the other
    arms' windows run, as the dataloader technique's workers would: such arms cannot share a block.
    They shared it, with a note that said so."""
    data = _loader_with_workers() if given == "loader" else _loader_with_workers
    table = wb.plan(model=lambda: torch.nn.Linear(3, 2), data=data, techniques=["grad_accum"], device="cpu")
    assert set(table.process) == {"own"}, table[["name", "process"]]
    assert table.own_process.str.contains("loads in 1 worker process").all(), table.own_process.tolist()
    without_workers = torch.utils.data.DataLoader(_loader_with_workers().dataset, batch_size=8)
    shared = wb.plan(
        model=lambda: torch.nn.Linear(3, 2), data=without_workers, techniques=["grad_accum"], device="cpu"
    )
    assert set(shared.process) == {"block"}, shared[["name", "process"]]
