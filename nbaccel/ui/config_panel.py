"""``nbaccel.configure()``: a form for the launch config, built from the detected hardware.

The choice logic (which precisions this machine can run, and why not) is plain functions, so it
is testable without widgets and the text form shows the same facts. The form edits a live
:class:`~nbaccel.core.config.LaunchConfig`: the object ``configure()`` returned changes as the user
changes the widgets, so ``notebook_launcher(fn, config=cfg)`` in a later cell uses what is shown.
"""

from __future__ import annotations

import dataclasses
import html
import os
from typing import Any

from nbaccel.core import capabilities, hardware, parallelism_settings, strategy_registry
from nbaccel.core.config import MIXED_PRECISION_CHOICES, ConfigError, LaunchConfig

LABEL_WIDTH = "15em"  # wide enough for "gradient accumulation steps"


@dataclasses.dataclass(frozen=True)
class Choice:
    value: str
    enabled: bool
    reason: str = ""  # why it is disabled; empty when enabled


def precision_choices(hw: hardware.Hardware, torchao: bool | None = None) -> list[Choice]:
    """Each mixed-precision mode, enabled or not on ``hw``, with the reason when not.

    >>> [c.value for c in precision_choices(hardware.Hardware(cpu_count=2)) if c.enabled]
    ['no', 'fp16', 'bf16']
    """
    torchao = capabilities.torchao_available() if torchao is None else torchao
    verdicts = {
        name: capabilities.precision_verdict(name, hw.gpus, torchao)
        for name in MIXED_PRECISION_CHOICES
    }
    return [Choice(name, v.allowed, v.reason) for name, v in verdicts.items()]


def max_processes(hw: hardware.Hardware) -> int:
    """One rank per GPU where there are GPUs, else up to one per CPU core."""
    return hw.gpu_count or hw.cpu_count


def hardware_lines(hw: hardware.Hardware) -> list[str]:
    lines = [f"CPU: {hw.cpu_count} core{'s' if hw.cpu_count != 1 else ''}"]
    for g in hw.gpus:
        cc = f"{g.compute_capability[0]}.{g.compute_capability[1]}"
        lines.append(f"GPU {g.index}: {g.name}, {g.memory_gib:.1f} GiB, compute capability {cc}")
    if not hw.gpus:
        lines.append("GPU: none visible")
    lines.append(f"TPU: {'detected' if hw.has_tpu else 'none'}")
    lines.append(f"Apple MPS: {'available' if hw.has_mps else 'no'}")
    return lines


def prepare_config(cfg: LaunchConfig, hw: hardware.Hardware, choices: list[Choice]) -> list[str]:
    """Make ``cfg`` runnable here, in place; return notes on what had to change."""
    notes = []
    enabled = {c.value for c in choices if c.enabled}
    if cfg.mixed_precision not in enabled:
        notes.append(f"saved mixed_precision={cfg.mixed_precision!r} cannot run here; using 'no'")
        cfg.mixed_precision = "no"
    limit = max_processes(hw)
    if cfg.num_processes is None:
        cfg.num_processes = hw.gpu_count or 1
    elif cfg.num_processes > limit:
        notes.append(f"saved num_processes={cfg.num_processes} is more than this machine's {limit}")
        cfg.num_processes = limit
    return notes


def panel_text(
    cfg: LaunchConfig, hw: hardware.Hardware, choices: list[Choice], path: os.PathLike | str
) -> str:
    """The panel as plain text, for frontends without widgets."""
    lines = ["nbaccel launch configuration", "  hardware:"]
    lines += [f"    {line}" for line in hardware_lines(hw)]
    lines.append(f"  num_processes: {cfg.num_processes} (1-{max_processes(hw)})")
    marks = []
    for c in choices:
        current = "*" if c.value == cfg.mixed_precision else ""
        marks.append(f"{current}{c.value}" if c.enabled else f"({c.value}: {c.reason})")
    lines.append(f"  mixed_precision: {', '.join(marks)}")
    lines.append(f"  strategy: {cfg.strategy} (one of {', '.join(strategy_registry.names())})")
    lines.append(f"  gradient_accumulation_steps: {cfg.gradient_accumulation_steps}")
    sizes = parallelism_settings.sizes_of(cfg.to_dict())
    lines.append(f"  parallelism: {', '.join(f'{d}_size={n}' for d, n in sizes.items())}")
    lines.append(f"  config file: {path}")
    lines.append(
        "  change fields on the returned config (cfg.mixed_precision = 'bf16'), then "
        "cfg.save() to make it the default"
    )
    return "\n".join(lines)


class ConfigPanel:
    """The widget form. ``config`` is the live LaunchConfig that the widgets edit."""

    def __init__(
        self,
        config: LaunchConfig,
        hw: hardware.Hardware,
        path: os.PathLike | str | None = None,
        torchao: bool | None = None,
    ) -> None:
        import ipywidgets as w

        from nbaccel.core.config import default_config_path

        self.config = config
        self.hw = hw
        self.path = path if path is not None else default_config_path()
        self.choices = precision_choices(hw, torchao)
        notes = prepare_config(config, hw, self.choices)

        hw_html = "".join(f"<li>{html.escape(line)}</li>" for line in hardware_lines(hw))
        self.hardware = w.HTML(
            f"<div class='nbaccel-hardware'><b>Detected hardware</b><ul style='margin:2px 0'>"
            f"{hw_html}</ul></div>"
        )
        self.num_processes = w.BoundedIntText(
            value=config.num_processes, min=1, max=max_processes(hw), layout={"width": "8em"}
        )
        self.precision: dict[str, Any] = {}
        for c in self.choices:
            self.precision[c.value] = w.ToggleButton(
                value=c.value == config.mixed_precision,
                description=c.value,
                disabled=not c.enabled,
                tooltip=c.reason or f"mixed_precision={c.value!r}",
                layout={"width": "6em"},
            )
            self.precision[c.value].observe(self._on_precision, names="value")
        reasons = "".join(
            f"<div style='color:#57606a'>{html.escape(c.reason)}</div>"
            for c in self.choices
            if not c.enabled
        )
        self.precision_reasons = w.HTML(f"<div class='nbaccel-disabled-reasons'>{reasons}</div>")
        self.strategy = w.ToggleButtons(
            options=[(s.upper(), s) for s in strategy_registry.names()],
            value=config.strategy,
            style={"button_width": "auto"},  # whole names ("DEEPSPEED"), not "DEEPS..."
        )
        self.gradient_accumulation_steps = w.BoundedIntText(
            value=config.gradient_accumulation_steps, min=1, max=4096, layout={"width": "8em"}
        )
        # N-D parallelism: ParallelismConfig's sizes, one box each (their product: the ranks)
        self.parallelism = {
            field: w.BoundedIntText(
                value=getattr(config, field),
                min=1,
                max=4096,
                description=field.removeprefix("parallelism_config_").removesuffix("_size"),
                layout={"width": "11em"},
            )
            for field in parallelism_settings.ENV
        }
        self.save_button = w.Button(description="save as default", icon="save")
        self.status = w.HTML(
            "".join(f"<div style='color:#9a6700'>{html.escape(n)}</div>" for n in notes)
        )

        self.num_processes.observe(self._on_change("num_processes"), names="value")
        self.strategy.observe(self._on_change("strategy"), names="value")
        self.gradient_accumulation_steps.observe(
            self._on_change("gradient_accumulation_steps"), names="value"
        )
        for field, box in self.parallelism.items():
            box.observe(self._on_change(field), names="value")
        self.save_button.on_click(self._on_save)

        def row(name: str, *controls: Any) -> Any:
            """Every field the same way: its full name in one fixed-width column, left-aligned."""
            label = w.Label(name, layout={"width": LABEL_WIDTH, "min_width": LABEL_WIDTH})
            box = w.HBox([label, *controls], layout={"align_items": "center"})
            slug = name.replace(" ", "-")
            box.add_class(f"nbaccel-field-{slug}")
            for control in controls:
                control.add_class(f"nbaccel-{slug}")
            return box

        self.widget = w.VBox(
            [
                self.hardware,
                row("processes", self.num_processes),
                row("mixed precision", *self.precision.values()),
                self.precision_reasons,
                row("strategy", self.strategy),
                row("gradient accumulation steps", self.gradient_accumulation_steps),
                row("parallelism sizes", *self.parallelism.values()),
                w.HBox([self.save_button, self.status]),
            ]
        )
        self.widget.add_class("nbaccel-config")

    def sync(self, *_: Any) -> None:
        """Show the config's current values: ``cfg.num_processes = 2`` in a cell shows in the
        form once that cell has run (``configure()`` calls this after every cell)."""
        cfg = self.config
        if cfg.num_processes is not None and self.num_processes.value != cfg.num_processes:
            self.num_processes.value = min(cfg.num_processes, self.num_processes.max)
        if self.strategy.value != cfg.strategy and cfg.strategy in strategy_registry.names():
            self.strategy.value = cfg.strategy
        if self.gradient_accumulation_steps.value != cfg.gradient_accumulation_steps:
            self.gradient_accumulation_steps.value = cfg.gradient_accumulation_steps
        for field, box in self.parallelism.items():
            if box.value != getattr(cfg, field):
                box.value = getattr(cfg, field)
        chosen = self.precision.get(cfg.mixed_precision)
        if chosen is not None and not chosen.value and not chosen.disabled:
            chosen.value = True  # its handler clears the others

    def _on_change(self, field: str) -> Any:
        def handler(change: dict[str, Any]) -> None:
            setattr(self.config, field, change["new"])

        return handler

    def _on_precision(self, change: dict[str, Any]) -> None:
        """Behave as one radio group; a disabled mode never becomes the selection."""
        button = change["owner"]
        value = button.description
        if change["new"]:
            if button.disabled:
                button.value = False
                return
            self.config.mixed_precision = value
            for other, b in self.precision.items():
                if other != value and b.value:
                    b.value = False
        elif value == self.config.mixed_precision:
            button.value = True  # clicking the chosen mode again keeps it chosen

    def _on_save(self, _button: Any = None) -> None:
        try:
            target = self.config.validate().save(self.path)
        except (ConfigError, OSError) as exc:
            self.status.value = (
                f"<span style='color:#cf222e'>not saved: {html.escape(str(exc))}</span>"
            )
            return
        self.status.value = (
            f"<span style='color:#1a7f37'>saved to {html.escape(str(target))}</span>"
        )

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)


def configure(path: os.PathLike | str | None = None) -> LaunchConfig:
    """Show the launch-config form and return the config it edits (live).

    Starts from the config file at ``path`` (default: the shared default file, which
    ``notebook_launcher`` and ``nbaccel launch`` read) when there is one. "save as default"
    writes the form's values there. Where widgets cannot render, the same facts print as text.

    In a notebook: ``cfg = nbaccel.configure()``, pick bf16, 2 processes, ..., then in a later
    cell ``nbaccel.notebook_launcher(train, config=cfg)``. Without widgets (here, a doctest):

    >>> import tempfile, pathlib
    >>> with tempfile.TemporaryDirectory() as folder:  # doctest: +ELLIPSIS
    ...     path = LaunchConfig(num_processes=2).save(pathlib.Path(folder) / "nbaccel.yaml")
    ...     cfg = configure(path)
    nbaccel launch configuration
      hardware:
        CPU: ...
      num_processes: 2 (...)
    ...
    >>> cfg.num_processes
    2
    """
    from nbaccel.core.config import default_config_path
    from nbaccel.ui import widget_frontend

    target = path if path is not None else default_config_path()
    cfg = LaunchConfig.load(target) if os.path.isfile(target) else LaunchConfig()
    hw = hardware.detect()
    if widget_frontend():
        panel = ConfigPanel(cfg, hw, target)
        from IPython.display import display

        display(panel.widget)
        follow_cells(panel)
        return cfg
    choices = precision_choices(hw)
    notes = prepare_config(cfg, hw, choices)
    print("\n".join([panel_text(cfg, hw, choices, target), *(f"  note: {n}" for n in notes)]))
    return cfg


def follow_cells(panel: ConfigPanel) -> None:
    """Re-sync ``panel`` with its config after every cell, for as long as the panel exists.

    Assignments to a LaunchConfig cannot be observed, but a kernel runs cells one at a time, so
    syncing after each cell shows every change a cell made.
    """
    import weakref

    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is None:
        return
    ref = weakref.ref(panel)

    def after_cell(*_: Any) -> None:
        alive = ref()
        if alive is None:
            shell.events.unregister("post_run_cell", after_cell)
            return
        alive.sync()

    shell.events.register("post_run_cell", after_cell)
