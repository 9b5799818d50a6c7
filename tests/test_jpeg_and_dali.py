"""JPEG folders, the DataLoader baseline, the dali technique, loader-only arms and sweeps."""

import math
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from workbench.datasets import jpeg

import workbench as wb
from workbench import optional
from workbench.data import resolve_data
from workbench.jpeg_folder import (
    CROP_ASPECT,
    JpegDataset,
    JpegFolder,
    random_resized_crop_box,
    scan,
)
from workbench.techniques import Context, get_technique

HAS_DALI = optional.missing("nvidia.dali") is None
needs_dali = pytest.mark.skipif(not HAS_DALI, reason="DALI is not installed (pip install 'workbench[dali]')")
CPU = torch.device("cpu")
CROP = 24


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A small ImageFolder: 6 classes x 16 JPEG files of 48 px."""
    return jpeg.build(tmp_path_factory.mktemp("jpeg") / "images", images_per_class=16, size=48)


@pytest.fixture
def copy_of(folder, tmp_path):
    def make() -> Path:
        target = tmp_path / "copy"
        shutil.copytree(folder, target)
        return target

    return make


# ----- the folder and its scan -------------------------------------------------------------


def test_the_dataset_command_says_what_it_wrote_and_how_to_train_on_it(tmp_path):
    """`python -m workbench.datasets.jpeg` printed a bare path, and its usage line named jpeg.py."""
    import subprocess
    import sys

    out = tmp_path / "photos"
    command = [sys.executable, "-m", "workbench.datasets.jpeg", "--out", str(out), "--images-per-class", "2"]
    done = subprocess.run([*command, "--size", "16"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (
        f"wrote 6 classes x 2 JPEG files of 16 px in {out}; train on them with --data jpeg-folder:{out} "
        f"(or data='jpeg-folder:{out}')"
    )
    assert len(list(out.glob("*/*.jpg"))) == 12
    usage = subprocess.run([*command[:3], "--help"], capture_output=True, text=True, timeout=120).stdout
    assert usage.startswith("usage: python -m workbench.datasets.jpeg")


def test_scan_lists_classes_in_sorted_order_with_matching_labels(folder):
    images = scan(JpegFolder(str(folder), size=CROP))
    assert images.classes == sorted(jpeg.CLASSES)
    assert len(images.files) == 6 * 16
    for path, label in zip(images.files, images.labels, strict=True):
        assert Path(path).parent.name == images.classes[label]
    assert images.skipped == []


def test_builtin_jpeg_data_builds_once_and_sizes_the_model():
    source = resolve_data("jpeg", "resnet-mini")
    assert source.spec.shape == (3, jpeg.CROP, jpeg.CROP)
    assert source.spec.num_classes == len(jpeg.CLASSES)
    assert len(source.images.files) == jpeg.IMAGES_PER_CLASS * len(jpeg.CLASSES)
    assert "jpeg" in set(wb.list_datasets().name)


def test_jpeg_folder_string_form_equals_the_object(folder):
    by_string = resolve_data(f"jpeg-folder:{folder}", "mlp")
    by_object = resolve_data(JpegFolder(str(folder)), "mlp")
    assert by_string.images.files == by_object.images.files
    assert by_string.label == f"jpeg-folder:{folder}"


def test_gpt_mini_refuses_images(folder):
    with pytest.raises(ValueError, match="'gpt-mini' trains on tokens data, not JPEG images"):
        resolve_data(f"jpeg-folder:{folder}", "gpt-mini")


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda root: root / "missing", "does not exist"),
        (lambda root: (root / "file.txt").write_text("x") and root / "file.txt", "is a file, not a folder"),
        (lambda root: root, "has no class subfolders"),
    ],
    ids=["missing", "a-file", "empty"],
)
def test_bad_folders_fail_clearly(tmp_path, make, message):
    with pytest.raises(ValueError, match=message):
        scan(JpegFolder(str(make(tmp_path))))


def test_images_outside_class_folders_are_refused(copy_of):
    root = copy_of()
    shutil.copy(next((root / "coffee").iterdir()), root / "stray.jpg")
    with pytest.raises(ValueError, match=r"1 JPEG file\(s\) lie directly in the root.*stray.jpg"):
        scan(JpegFolder(str(root)))


def test_only_jpegs_at_the_top_level_is_not_an_imagefolder(tmp_path, folder):
    shutil.copy(next((folder / "coffee").iterdir()), tmp_path / "a.jpg")
    with pytest.raises(ValueError, match="no class subfolders; it holds 1 JPEG files directly"):
        scan(JpegFolder(str(tmp_path)))


def test_an_empty_class_folder_is_refused(copy_of):
    root = copy_of()
    (root / "zebra").mkdir()
    with pytest.raises(ValueError, match="class folder 'zebra' holds no JPEG files"):
        scan(JpegFolder(str(root)))


def test_class_folders_must_match_the_expected_classes(folder):
    expected = [*jpeg.CLASSES[:-1], "zebra"]
    with pytest.raises(ValueError, match="missing: zebra; unexpected: hubble_deep_field"):
        scan(JpegFolder(str(folder), classes=expected))
    assert scan(JpegFolder(str(folder), classes=list(jpeg.CLASSES))).classes == sorted(jpeg.CLASSES)


def _corrupt(root: Path) -> list[Path]:
    """Truncate one file and overwrite another with text: two kinds of corruption."""
    truncated, garbage = sorted((root / "chelsea").iterdir())[:2]
    data = truncated.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    garbage.write_text("this is not a JPEG")
    return [truncated, garbage]


def test_corrupt_files_are_skipped_and_counted(copy_of):
    root = copy_of()
    bad = _corrupt(root)
    with pytest.warns(UserWarning, match=r"skipped 2 corrupt JPEG file\(s\) of 96"):
        images = scan(JpegFolder(str(root), on_corrupt="skip"))
    assert len(images.files) == 94
    assert {str(p) for p in bad}.isdisjoint(images.files)
    assert {Path(f) for f, _ in images.skipped} == set(bad)
    assert images.note().startswith("2 corrupt JPEG file(s) left out")


def test_the_command_line_says_corrupt_files_were_skipped_in_one_line(copy_of, capsys):
    """The warning came out as Python's, with workbench's source file and line and the line of code."""
    from workbench.cli import main

    root = copy_of()
    _corrupt(root)
    argv = [
        "ablate",
        "--model",
        "resnet-mini",
        "--data",
        f"jpeg-folder:{root}",
        "-t",
        "channels_last",
        "--dry-run",
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        assert main(argv) == 0
    said = capsys.readouterr().err
    assert said.startswith(
        f"workbench: warning: jpeg-folder '{root}': skipped 2 corrupt JPEG file(s) of 96"
    ), said
    assert "UserWarning" not in said and ".py:" not in said
    assert (
        said.count("skipped 2 corrupt") == 1
    )  # the folder scanned once, though checked twice (plan, then out)


def test_a_multi_picture_jpeg_from_a_phone_is_a_jpeg(copy_of):
    """An MPO file (a JPEG with more pictures after the first) was refused as "not a JPEG but MPO"."""
    from PIL import Image

    root = copy_of()
    photo = sorted((root / "chelsea").iterdir())[0]
    with Image.open(photo) as image:
        first = image.convert("RGB")
    first.save(photo, format="MPO", save_all=True, append_images=[first.rotate(90)])
    with Image.open(photo) as image:
        assert image.format == "MPO"
    images = scan(JpegFolder(str(root), on_corrupt="raise"))
    assert str(photo) in images.files and not images.skipped


def test_corrupt_files_raise_naming_the_file_when_asked(copy_of):
    root = copy_of()
    bad = _corrupt(root)
    with pytest.raises(ValueError, match=rf"corrupt JPEG {bad[0]}.*and 1 more.*on_corrupt='skip'"):
        scan(JpegFolder(str(root), on_corrupt="raise"))


def test_a_class_with_only_corrupt_files_is_refused(tmp_path, folder):
    root = tmp_path / "root"
    shutil.copytree(folder / "coffee", root / "coffee")
    (root / "broken").mkdir()
    (root / "broken" / "a.jpg").write_text("nope")
    with (
        warnings.catch_warnings(),
        pytest.raises(ValueError, match="every JPEG in class folder 'broken' is corrupt"),
    ):
        warnings.simplefilter("ignore")
        scan(JpegFolder(str(root)))


def test_folder_settings_are_validated():
    with pytest.raises(ValueError, match="jpeg-folder: on_corrupt must be one of 'skip' | 'raise'"):
        JpegFolder("x", on_corrupt="ignore")
    with pytest.raises(ValueError, match="jpeg-folder: size must be >= 8"):
        JpegFolder("x", size=4)
    with pytest.raises(ValueError, match="classes must be a list of folder names"):
        JpegFolder("x", classes="abc")


@settings(max_examples=200, deadline=None)
@given(height=st.integers(1, 400), width=st.integers(1, 400), seed=st.integers(0, 2**32 - 1))
def test_random_resized_crop_box_always_fits(height, width, seed):
    left, top, right, bottom = random_resized_crop_box(height, width, np.random.default_rng(seed))
    assert 0 <= left < right <= width and 0 <= top < bottom <= height
    aspect = (right - left) / (bottom - top)
    # Either an allowed aspect ratio (up to rounding to whole pixels) or the whole side of a thin image.
    slack = 1 / min(right - left, bottom - top) + 1e-9
    assert CROP_ASPECT[0] * (1 - slack) - slack <= aspect <= CROP_ASPECT[1] * (1 + slack) + slack or (
        right - left == width or bottom - top == height
    )


# ----- the two pipelines agree -------------------------------------------------------------


def _dataloader_batches(images, batch_size, count):
    np.random.seed(0)
    loader = torch.utils.data.DataLoader(
        JpegDataset(images),
        batch_size=batch_size,
        shuffle=True,
        drop_last=True,
        generator=torch.Generator().manual_seed(0),
    )
    batches = []
    while len(batches) < count:
        batches += list(loader)
    return batches[:count]


def _dali_batches(images, batch_size, count, **options):
    from workbench.techniques.dali import DaliConfig, dali_batches

    iterator = dali_batches(images, DaliConfig(threads=1, **options), batch_size, seed=0, device=CPU)
    return [next(iterator) for _ in range(count)]


@needs_dali
def test_parity_shapes_dtype_layout_and_channel_statistics(folder):
    images = scan(JpegFolder(str(folder), size=CROP))
    count = 12  # 12 batches of 16: two epochs of random crops per pipeline
    torch_side = _dataloader_batches(images, 16, count)
    dali_side = _dali_batches(images, 16, count)
    for (x_torch, y_torch), (x_dali, y_dali) in zip(torch_side, dali_side, strict=True):
        assert x_torch.shape == x_dali.shape == (16, 3, CROP, CROP)
        assert x_torch.dtype == x_dali.dtype == torch.float32
        assert x_torch.is_contiguous() and x_dali.is_contiguous()  # both CHW, not HWC views
        assert y_torch.dtype == y_dali.dtype == torch.int64
        assert y_torch.shape == y_dali.shape == (16,)
    pixels = {
        side: torch.cat([x for x, _ in batches]).transpose(0, 1).reshape(3, -1)
        for side, batches in (("torch", torch_side), ("dali", dali_side))
    }
    mean_torch, mean_dali = pixels["torch"].mean(1), pixels["dali"].mean(1)
    std_torch, std_dali = pixels["torch"].std(1), pixels["dali"].std(1)
    # Same files, same transforms, different random crops: the statistics agree closely, not exactly.
    assert torch.allclose(mean_torch, mean_dali, atol=0.12), (mean_torch, mean_dali)
    assert torch.allclose(std_dali / std_torch, torch.ones(3), atol=0.08), (std_torch, std_dali)
    # Both see every class about equally often.
    for side in (torch_side, dali_side):
        counts = torch.bincount(torch.cat([y for _, y in side]), minlength=6)
        assert counts.min() > 0


@needs_dali
def test_dali_labels_follow_the_class_folders(folder):
    from workbench.techniques.dali import DaliConfig, build_pipeline

    images = scan(JpegFolder(str(folder), size=CROP))
    pipeline = build_pipeline(images, DaliConfig(threads=3), 32, seed=0, device=CPU, with_source_info=True)
    assert pipeline.num_threads == 3  # the threads setting reaches DALI (a mutation audit: it could be lost)
    for _ in range(3):
        _, labels, sources = pipeline.run()
        for index in range(len(labels)):
            path = Path(bytes(np.asarray(sources[index])).decode())
            assert images.classes[int(np.asarray(labels[index]).item())] == path.parent.name


@needs_dali
def test_dali_shards_are_disjoint_and_cover_the_files(folder):
    from workbench.techniques.dali import DaliConfig, build_pipeline

    images = scan(JpegFolder(str(folder), size=CROP))
    seen = []
    for shard in range(2):
        config = DaliConfig(threads=1, shard_id=shard, num_shards=2)
        pipeline = build_pipeline(images, config, 48, seed=0, device=CPU, with_source_info=True)
        _, _, sources = pipeline.run()  # one batch of 48 = the whole shard of 96 / 2
        seen.append({bytes(np.asarray(sources[i])).decode() for i in range(48)})
    assert seen[0].isdisjoint(seen[1])
    assert seen[0] | seen[1] == set(images.files)


# ----- the dali technique ------------------------------------------------------------------


def _context(data, model="mlp", device=CPU):
    source = resolve_data(data, model)
    return Context(
        device=device,
        data_label=source.label,
        image_size=source.images.size if source.images is not None else None,
    )


def test_dali_settings_are_validated():
    dali = get_technique("dali")
    with pytest.raises(ValueError, match=r"dali: shard_id must be below num_shards \(2\); got 2"):
        dali.configure({"shard_id": 2, "num_shards": 2})
    with pytest.raises(ValueError, match="dali: decode must be one of 'auto' | 'cpu' | 'mixed'"):
        dali.configure({"decode": "gpu"})
    with pytest.raises(ValueError, match="dali: threads must be >= 1"):
        dali.configure({"threads": 0})


def test_dali_needs_jpeg_files(folder):
    dali = get_technique("dali")
    reason = dali.unavailable_reason(_context("digits"), dali.Config())
    if HAS_DALI:
        assert reason.startswith("needs JPEG files to decode") and "this data is digits" in reason
    assert dali.unavailable_reason(_context(f"jpeg-folder:{folder}"), dali.Config()) in (None, reason)


@needs_dali
def test_mixed_decode_needs_a_gpu(folder):
    dali = get_technique("dali")
    reason = dali.unavailable_reason(_context(f"jpeg-folder:{folder}"), dali.configure({"decode": "mixed"}))
    assert "decode='mixed' runs nvJPEG on a GPU" in reason


def test_output_size_must_match_the_data(folder):
    with pytest.raises(ValueError, match="dali: output_size=48 differs from the data's crop size 24"):
        wb.plan(
            model="mlp",
            data=JpegFolder(str(folder), size=CROP),
            techniques={"dali": {"output_size": 48}},
            device="cpu",
        )


def test_shards_smaller_than_a_batch_are_refused_before_any_arm_runs(folder):
    """Refused only once the arm's process had started, after the plan had accepted it."""
    with pytest.raises(
        ValueError, match=r"dali: 4 shards of 96 images hold about 24 each, fewer than batch_size=32"
    ):
        wb.plan(model="mlp", data=JpegFolder(str(folder), size=CROP), techniques={"dali": {"num_shards": 4}},
                batch_size=32, device="cpu")  # fmt: skip


def test_dali_and_dataloader_cannot_share_an_arm(folder):
    with pytest.raises(
        ValueError, match="dataloader and dali cannot be combined: both replace the input pipeline"
    ):
        wb.plan(
            model="mlp",
            data=f"jpeg-folder:{folder}",
            techniques={"dali": True, "dataloader": True},
            mode="leave-one-out",
            device="cpu",
        )


def test_dali_without_dali_installed_names_the_extra(monkeypatch):
    monkeypatch.setattr(optional.importlib.util, "find_spec", lambda name: None)
    reason = get_technique("dali").unavailable_reason(Context(device=CPU), get_technique("dali").Config())
    assert "pip install 'workbench[dali]'" in reason


# ----- sweeps and loader-only arms ---------------------------------------------------------


def test_a_list_of_values_sweeps_a_setting(folder):
    plan = wb.plan(
        model="mlp",
        data=f"jpeg-folder:{folder}",
        device="cpu",
        control=False,
        techniques={"dataloader": {"num_workers": [0, 2]}, "amp": True},
        loader_arms=False,
    )
    assert list(plan.name) == [
        "baseline",
        "baseline (own process)",  # dataloader workers run alone: a baseline that does too
        "dataloader[num_workers=0]",
        "dataloader[num_workers=2]",
        "amp",
    ]


def test_a_sweep_over_workers_keeps_the_workers_settings_for_the_arms_with_workers():
    """prefetch_factor=4 beside num_workers=[0, 2] refused the whole sweep: it needs workers, and
    the first arm has none. Given alone, it is still refused."""
    techniques = {
        "dataloader": {"num_workers": [0, 2, 4], "prefetch_factor": [2, 4], "persistent_workers": False}
    }
    plan = wb.plan(model="mlp", techniques=techniques, device="cpu", control=False, loader_arms=False)
    assert list(plan.name)[2:] == [
        "dataloader[num_workers=0]",  # one arm: prefetching means nothing without workers
        *(f"dataloader[num_workers={n}, prefetch_factor={p}]" for n in (2, 4) for p in (2, 4)),
    ]
    described = dict(zip(plan.name, plan.techniques, strict=True))
    assert described["dataloader[num_workers=0]"] == "dataloader(num_workers=0, pin_memory=True)"
    assert described["dataloader[num_workers=4, prefetch_factor=2]"].endswith(
        "prefetch_factor=2, persistent_workers=False)"
    )
    with pytest.raises(ValueError, match="prefetch_factor needs num_workers > 0"):
        wb.plan(
            model="mlp", techniques={"dataloader": {"num_workers": 0, "prefetch_factor": 4}}, device="cpu"
        )


@pytest.mark.parametrize(
    "techniques, mode, message",
    [
        (
            {"dataloader": {"num_workers": []}},
            "one-at-a-time",
            "dataloader: the sweep over num_workers is empty",
        ),
        ({"dataloader": {"num_workers": [1, 1]}}, "one-at-a-time", "repeats a value"),
        ({"dataloader": {"num_workers": [1, 2]}}, "leave-one-out", "leave-one-out cannot"),
    ],
)
def test_bad_sweeps_fail_clearly(techniques, mode, message):
    with pytest.raises(ValueError, match=message):
        wb.plan(model="mlp", techniques=techniques, mode=mode, device="cpu")


def test_loader_arms_are_planned_for_input_pipeline_techniques(folder):
    data = f"jpeg-folder:{folder}"
    techniques = {"dataloader": {"num_workers": [0, 1]}, "amp": True}
    plan = wb.plan(model="mlp", data=data, techniques=techniques, device="cpu")
    loader = plan[plan.name.str.startswith("loader: ")]
    assert list(loader.name) == [
        "loader: baseline",
        "loader: baseline (own process)",
        "loader: dataloader[num_workers=0]",
        "loader: dataloader[num_workers=1]",
    ]
    assert list(loader.role) == ["baseline", "baseline", "treatment", "treatment"]
    assert not plan.name.str.startswith("loader: ").any() or "loader: amp" not in set(plan.name)
    without = wb.plan(model="mlp", data=data, techniques=techniques, device="cpu", loader_arms=False)
    assert not without.name.str.startswith("loader: ").any()
    # Nothing to time without an input-pipeline technique, unless asked for.
    assert (
        not wb.plan(model="mlp", techniques={"amp": True}, device="cpu").name.str.startswith("loader").any()
    )


def test_a_conflicting_grid_cell_stays_unavailable_in_its_loader_twin(folder):
    plan = wb.plan(
        model="mlp",
        data=f"jpeg-folder:{folder}",
        techniques={"dataloader": True, "dali": True},
        mode="grid",
        device="cpu",
        control=False,
    ).set_index("name")
    for name in ("dataloader+dali", "loader: dataloader+dali"):
        assert plan.loc[name, "unavailable"].startswith("dataloader and dali cannot be combined")
        assert plan.loc[name, "blocks"] == 0


@pytest.mark.slow  # a real ablation in fresh processes
def test_ablate_gives_loader_and_training_rows_for_both_pipelines(folder):
    techniques = {"dataloader": {"num_workers": 1}}
    if HAS_DALI:
        techniques["dali"] = {"threads": 1}
    res = wb.ablate(
        model="mlp",
        data=JpegFolder(str(folder), size=CROP),
        techniques=techniques,
        steps=4,
        warmup=1,
        blocks=1,
        batch_size=16,
        device="cpu",
        out=False,
        progress=False,
        control=False,
    )
    table = res.table.set_index("arm")
    assert (table.status == "ok").all(), table[["status", "reason"]]
    pipelines = ["baseline", *techniques]
    for name in pipelines:
        assert table.loc[name, "kind"] == "train"
        assert math.isfinite(table.loc[name, "final_loss"])
        loader = table.loc[f"loader: {name}"]
        assert loader.kind == "loader"
        assert loader.samples_per_s > 0 and math.isnan(loader.final_loss)
        assert "loader only" in loader.notes
    curves = set(res.losses.arm)  # a loader-only arm's no-op model has a loss that means nothing
    assert set(pipelines) <= curves and not [arm for arm in curves if arm.startswith("loader:")]
    # Each kind is compared with its own baseline, in the same kind of process.
    assert table.loc["loader: baseline", "speedup"] == 1.0
    assert table.loc["baseline", "speedup"] == 1.0
    assert table.loc["dataloader", "process"] == table.loc["loader: dataloader", "process"] == "own"
