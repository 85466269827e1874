"""A training job described in one YAML file: model, data, loss, metrics and TrainingArguments.

::

    model:
      factory: model.py:build_model      # FILE.py:function (relative to this YAML) or package.module:function
      kwargs: {depth: 4, width: 64}
      # or: pretrained: gpt2-small/      # a Hugging Face folder (config.json + safetensors), relative to
      #                                  # this YAML; with a factory too, factory(config, **kwargs) builds it
    data:
      factory: data.py:build_datasets    # returns (train_dataset, eval_dataset) or train_dataset
      kwargs: {num_digits: 2}
      labels: shifted                    # shifted (default): label t is the target of output t;
                                         # unshifted: labels = input_ids (transformers), Merak shifts them
                                         # or text: {format: jsonl, path: ..., tokenizer: ..., seq_len: ...}
                                         # (merak_core.data.text lists the keys)
    loss: null                           # FILE.py:function(output, labels) -> scalar; null: cross-entropy
    metrics: data.py:exact_match         # optional: fn(output, labels) -> per-example values
    collate: null                        # optional collate function
    training:                            # merak_core.TrainingArguments fields
      dp: 2
      tp: 2
      pp: 2

Overrides on the command line are ``section.key=value`` with a YAML value
(``training.max_steps=50``, ``model.kwargs.depth=2``). Everything is checked
when the file is read, before any process starts.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import sys
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from merak_core.config import (
    KEY_ALIASES,
    LABEL_CONVENTIONS,
    TrainingArguments,
    load_yaml,
    override_value,
    split_override,
)
from merak_core.config.layout_choice import LayoutChoice
from merak_core.config.values import read_utf8
from merak_core.data.text.job import FACTORY as TEXT_FACTORY
from merak_core.data.text.job import is_text_section, text_factory_kwargs
from merak_core.lora import LoraConfig, check_lora_arguments

SECTIONS = ("model", "data", "loss", "metrics", "collate", "training")
FACTORY_KEYS = ("factory", "kwargs")
DATA_KEYS = (*FACTORY_KEYS, "labels")
MODEL_KEYS = (*FACTORY_KEYS, "pretrained", "lora")


def load_callable(spec: str, *, base_dir: str | Path = ".", what: str = "callable") -> Callable[..., Any]:
    """Import ``FILE.py:name`` (relative to ``base_dir``) or ``package.module:name``."""
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise ValueError(
            f"{what}: {spec!r} is not of the form 'file.py:function' or 'package.module:function'"
        )
    target, name = spec.split(":")
    if target.endswith(".py"):
        path = (Path(base_dir) / target).resolve()
        if not path.is_file():
            raise ValueError(f"{what}: file {str(path)!r} (from {spec!r}) does not exist")
        module_name = f"_merak_job_{path.stem}_{abs(hash(str(path)))}"
        module = sys.modules.get(module_name)
        if module is None:
            loader_spec = importlib.util.spec_from_file_location(module_name, path)
            assert loader_spec is not None and loader_spec.loader is not None
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[module_name] = module
            sys.path.insert(0, str(path.parent))
            try:
                loader_spec.loader.exec_module(module)
            except Exception as exc:  # noqa: BLE001 - a broken file: one line naming it, not a traceback
                del sys.modules[module_name]  # the next attempt imports the fixed file again
                raise ValueError(
                    f"{what}: importing {str(path)!r} (from {spec!r}) failed: {_import_error(exc)}"
                ) from None
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise ValueError(f"{what}: cannot import module {target!r} (from {spec!r}): {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - e.g. a syntax error in the module
            raise ValueError(
                f"{what}: importing module {target!r} (from {spec!r}) failed: {_import_error(exc)}"
            ) from None
    try:
        fn = getattr(module, name)
    except AttributeError:
        defined = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise ValueError(
            f"{what}: {target!r} has no attribute {name!r}{_suggest(name, defined)}; it defines {defined}"
        ) from None
    if not callable(fn):
        raise ValueError(f"{what}: {spec!r} is not callable")
    return fn


def _import_error(exc: BaseException) -> str:
    """A failed import in one line: the error, the file and line it names, and what to fix."""
    if isinstance(exc, SyntaxError):
        return f"{type(exc).__name__}: {exc.msg} (at {exc.filename}:{exc.lineno}); fix the file"
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<")]
    where = f" (at {frames[-1].filename}:{frames[-1].lineno}: {frames[-1].line})" if frames else ""
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        return f"{type(exc).__name__}: {exc}{where}; install {exc.name!r} or fix the import"
    return f"{type(exc).__name__}: {exc}{where}; fix the file"


@dataclass(frozen=True)
class Factory:
    """A callable by import spec plus its keyword arguments."""

    spec: str | None
    kwargs: dict[str, Any] = field(default_factory=dict)
    pretrained: str | None = None
    """``model.pretrained``: the Hugging Face folder the weights come from (resolved against the job file)."""
    lora: LoraConfig | None = None
    """``model.lora``: train low-rank adapters on the frozen model (:mod:`merak_core.lora`)."""

    def load(self, base_dir: str | Path, what: str) -> Callable[..., Any]:
        if self.spec is None:
            raise ValueError(f"{what}: no factory is given (the model comes from model.pretrained)")
        return load_callable(self.spec, base_dir=base_dir, what=what)


@dataclass
class JobConfig:
    """The parsed job file (see the module docstring)."""

    model: Factory
    data: Factory
    training: TrainingArguments
    loss: str | None = None
    metrics: str | None = None
    collate: str | None = None
    base_dir: str = "."

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: Iterable[str] = ()) -> JobConfig:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"job file {str(path)!r} does not exist")
        raw = load_yaml(read_utf8(path, "job file"), str(path)) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"job file {str(path)!r} must hold a mapping with sections {SECTIONS}")
        for item in overrides:
            _apply_override(raw, item)
        return cls.from_dict(raw, base_dir=str(path.parent), source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, base_dir: str = ".", source: str = "job") -> JobConfig:
        for key in raw:
            if key not in SECTIONS:
                raise ValueError(
                    f"{source}: unknown section {key!r}{_suggest(key, SECTIONS)}; valid: {SECTIONS}"
                )
        for required in ("model", "data"):
            if required not in raw:
                raise ValueError(f"{source}: the '{required}' section is missing (it needs a 'factory')")
        data, labels = _data_labels(raw["data"], source)
        factories = {"model": _factory(raw["model"], "model", source, base_dir)}
        if is_text_section(data):  # text data: the built-in factory (merak_core.data.text.job)
            factories["data"] = Factory(
                TEXT_FACTORY, text_factory_kwargs(data, base_dir=base_dir, source=source)
            )
        else:
            factories["data"] = _factory(data, "data", source, base_dir)
        section = raw.get("training")
        if section is not None and not isinstance(section, dict):
            raise ValueError(
                f"{source}: the 'training' section must be a mapping of TrainingArguments keys, got "
                f"{type(section).__name__} {section!r}; write 'training:' and below it indented "
                "'key: value' lines (e.g. '  max_steps: 100')"
            )
        for name in ("loss", "metrics", "collate"):
            value = raw.get(name)
            if value is not None and not isinstance(value, str):
                raise ValueError(
                    f"{source}: '{name}' must be 'file.py:function' or 'package.module:function', got "
                    f"{type(value).__name__} {value!r}"
                )
        # ``training.labels`` is what ``TrainingArguments.to_yaml`` writes: the same setting as
        # ``data.labels``, accepted where the two do not disagree.
        if isinstance(section, dict) and "labels" in section and labels not in (None, section["labels"]):
            raise ValueError(
                f"{source}: training.labels={section['labels']!r} disagrees with data.labels={labels!r}: the "
                "label convention is a key of the data section: write it once, as 'data.labels'"
            )
        training = TrainingArguments.from_dict(
            {**(section or {}), **({} if labels is None else {"labels": labels})},
            source=f"{source}: training",
        )
        job = cls(
            model=factories["model"],
            data=factories["data"],
            training=training,
            loss=raw.get("loss"),
            metrics=raw.get("metrics"),
            collate=raw.get("collate"),
            base_dir=base_dir,
        )
        if job.model.spec is not None:
            job.model.load(base_dir, "model.factory")  # fail now on a bad spec, not on 8 ranks later
        if job.model.pretrained is not None:
            from merak_core.hf import PretrainedFolder

            PretrainedFolder(job.model.pretrained)  # a bad folder fails here, with its path and the fix
        job.data.load(base_dir, "data.factory")
        _fill_sample_tokenizer(job)
        _check_tp_plan_name(training.tp_plan, source)  # the factories may have registered it
        if job.model.lora is not None:
            _check_lora(job.model.lora, training, source)
        for name in ("loss", "metrics", "collate"):
            if getattr(job, name) is not None:
                load_callable(getattr(job, name), base_dir=base_dir, what=name)
        return job

    def build_model(self) -> Any:
        """The model: the factory's, or with ``model.pretrained`` the folder's, on the meta device."""
        if self.model.pretrained is not None:
            from merak_core.hf import pretrained_model

            factory = self.model.load(self.base_dir, "model.factory") if self.model.spec is not None else None
            return pretrained_model(
                self.model.pretrained,
                factory=factory,
                factory_kwargs=self.model.kwargs,
                dtype=self.training.torch_dtype,
            )
        return self.model.load(self.base_dir, "model.factory")(**self.model.kwargs)

    def build_datasets(self) -> tuple[Any, Any]:
        out = self.data.load(self.base_dir, "data.factory")(**self.data.kwargs)
        if isinstance(out, tuple):
            if len(out) != 2:
                raise ValueError(f"data.factory returned {len(out)} values: return train or (train, eval)")
            return out[0], out[1]
        return out, None

    def optional(self, name: str) -> Callable[..., Any] | None:
        spec = getattr(self, name)
        return None if spec is None else load_callable(spec, base_dir=self.base_dir, what=name)


def write_job(
    source: str | Path | None, out: str | Path, choice: LayoutChoice, *, overrides: Iterable[str] = ()
) -> None:
    """Write ``out``: the job file ``source`` (with ``overrides`` applied) whose training section gets
    ``choice`` (its :meth:`~merak_core.config.layout_choice.LayoutChoice.training_fields`).

    Used by ``merak plan --write-config`` and the plan check's ``replanned.yaml``. Aliases of the
    written keys are dropped, ``layout`` becomes ``manual`` when dp/tp/pp are written (the degrees
    are explicit), and ``FILE.py:function`` specs are made absolute when ``out`` lies in another
    directory. Without ``source`` the file holds the ``training`` section alone.
    """
    training = choice.training_fields()
    raw: dict[str, Any] = {}
    src_dir = Path(".").resolve()
    if source is not None:
        raw = load_yaml(Path(source).read_text(), str(source)) or {}
        for item in overrides:
            _apply_override(raw, item)
        src_dir = Path(source).resolve().parent
    section = raw.setdefault("training", {}) or {}
    raw["training"] = section
    for alias, name in KEY_ALIASES.items():
        if name in training:
            section.pop(alias, None)
    if {"dp", "tp", "pp"} & set(training) and section.get("layout") == "auto":
        section["layout"] = "manual"
    section.update(training)
    out_dir = Path(out).resolve().parent
    if source is not None and src_dir != out_dir:
        for name in ("model", "data"):
            spec = (raw.get(name) or {}).get("factory") if isinstance(raw.get(name), dict) else raw.get(name)
            if isinstance(spec, str) and spec.split(":")[0].endswith(".py"):
                if isinstance(raw[name], dict):
                    raw[name]["factory"] = str(src_dir / spec)
                else:
                    raw[name] = str(src_dir / spec)
        for name in ("loss", "metrics", "collate"):
            spec = raw.get(name)
            if isinstance(spec, str) and spec.split(":")[0].endswith(".py"):
                raw[name] = str(src_dir / spec)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        yaml.safe_dump(raw, f, sort_keys=False)


def _fill_sample_tokenizer(job: JobConfig) -> None:
    """``training.sample_prompts`` without ``sample_tokenizer``: the job's text tokenizer, else the pretrained
    folder's (None stays: the launch checks refuse it). Every reader of the job file (the ranks too) fills it."""
    t = job.training
    if t.sample_prompts and t.sample_tokenizer is None:
        from merak_core.generation.prompts import job_tokenizer

        t.sample_tokenizer = job_tokenizer(job)


def _check_tp_plan_name(tp_plan: Any, source: str) -> None:
    """A named TP plan (or a mapping's ``base``) is registered once the job's modules are imported."""
    name = tp_plan.get("base") if isinstance(tp_plan, dict) else tp_plan
    if not isinstance(name, str) or name == "auto":
        return
    import merak_tp

    try:
        merak_tp.get_plan(name)
    except ValueError as exc:
        raise ValueError(
            f"{source}: training.tp_plan={name!r}: {exc}; or use 'auto' (the built-in plan of the "
            "model type) or a mapping of module pattern -> style"
        ) from None


def _data_labels(section: Any, source: str) -> tuple[Any, str | None]:
    """The data section without ``labels``, and ``data.labels`` (None when not given), checked."""
    if not isinstance(section, dict) or "labels" not in section:
        return section, None
    value = section["labels"]
    if not isinstance(value, str) or value not in LABEL_CONVENTIONS:
        raise ValueError(
            f"{source}: data.labels={value!r} is invalid: expected 'shifted' (label t is the target of output t, "
            "the default) or 'unshifted' (labels = input_ids, the transformers convention: Merak shifts them)"
        )
    rest = {k: v for k, v in section.items() if k != "labels"}
    if value == "unshifted" and is_text_section(rest):
        raise ValueError(
            f"{source}: data.labels=unshifted with text data (data.format): text samples come with their labels "
            "shifted already; remove data.labels"
        )
    return rest, value


def _factory(section: Any, name: str, source: str, base_dir: str = ".") -> Factory:
    if isinstance(section, str):
        return Factory(section)
    keys = MODEL_KEYS if name == "model" else DATA_KEYS
    if not isinstance(section, dict) or not (
        "factory" in section or (name == "model" and "pretrained" in section)
    ):
        extra = " or 'pretrained: PATH' (a Hugging Face folder)" if name == "model" else ""
        raise ValueError(
            f"{source}: section '{name}' needs 'factory: file.py:function' (and optional 'kwargs'){extra}"
        )
    for key in section:
        if key not in keys:
            raise ValueError(f"{source}: unknown key {name}.{key}{_suggest(key, keys)}; valid: {keys}")
    kwargs = section.get("kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ValueError(f"{source}: {name}.kwargs must be a mapping, got {kwargs!r}")
    pretrained = section.get("pretrained")
    if pretrained is not None:
        if not isinstance(pretrained, str) or not pretrained:
            raise ValueError(
                f"{source}: model.pretrained must be the path of a Hugging Face folder, got "
                f"{type(pretrained).__name__} {pretrained!r}"
            )
        pretrained = str(Path(base_dir) / Path(pretrained).expanduser())
    lora = section.get("lora")
    if lora is not None:
        lora = LoraConfig.from_mapping(lora, base_dir=base_dir, source=source)
    return Factory(section.get("factory"), dict(kwargs), pretrained=pretrained, lora=lora)


def _check_lora(lora: LoraConfig, training: TrainingArguments, source: str) -> None:
    """``model.lora`` against the training options (and its ``from`` folder), before any process starts."""
    from merak_core.hf.adapters import check_adapter_folder

    auto = training.layout == "auto"
    try:
        tp, dp = (None, None) if auto else (training.tp, training.dp)
        check_lora_arguments(tp=tp, dp=dp, args=training, config=lora)
        check_adapter_folder(lora)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None


def _apply_override(raw: dict[str, Any], item: str) -> None:
    key, text = split_override(item, "'section.key=value' (e.g. training.max_steps=50)")
    parts = key.split(".")
    if parts[0] not in SECTIONS:
        raise ValueError(
            f"override {item!r}: unknown section {parts[0]!r}{_suggest(parts[0], SECTIONS)}; "
            f"valid: {SECTIONS}"
        )
    field = KEY_ALIASES.get(parts[-1], parts[-1]) if len(parts) == 2 and parts[0] == "training" else None
    if not text.strip():
        value = None
    elif field in TrainingArguments.field_names():  # typed like a flat override (config.override_value)
        value = override_value(field, text, source=f"override {item!r}")
    else:
        value = load_yaml(text, f"override {item!r}")
    node = raw
    for part in parts[:-1]:
        nxt = node.get(part)
        if nxt is None:
            nxt = node[part] = {}
        if not isinstance(nxt, dict):
            raise ValueError(f"override {item!r}: {part!r} is not a section")
        node = nxt
    node[parts[-1]] = value


def _suggest(word: str, options: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
