"""nbaccel.configure(): the choice logic, the widget form driven as a frontend would, the text form."""

from __future__ import annotations

import re

import pytest

from nbaccel.core.config import LaunchConfig
from nbaccel.core.hardware import GPU, Hardware
from nbaccel.ui.config_panel import ConfigPanel, configure, precision_choices
from tests.kernel_helpers import KernelSession

CPU = Hardware(cpu_count=4)
T4 = Hardware(cpu_count=8, gpus=(GPU(0, "Tesla T4", 15.0, (7, 5)),))
A100 = Hardware(cpu_count=8, gpus=(GPU(0, "A100", 80.0, (8, 0)), GPU(1, "A100", 80.0, (8, 0))))
H100 = Hardware(cpu_count=8, gpus=(GPU(0, "H100", 80.0, (9, 0)),))


def enabled(hw, torchao=False):
    return {c.value: c.enabled for c in precision_choices(hw, torchao=torchao)}


def reason(hw, value, torchao=False):
    return next(c.reason for c in precision_choices(hw, torchao=torchao) if c.value == value)


def test_precision_choices_follow_the_hardware():
    assert enabled(CPU) == {"no": True, "fp16": True, "bf16": True, "fp8": False}
    assert enabled(T4) == {"no": True, "fp16": True, "bf16": False, "fp8": False}
    assert "8.0" in reason(T4, "bf16") and "Tesla T4 has 7.5" in reason(T4, "bf16")
    assert "8.9" in reason(A100, "fp8") and enabled(A100)["bf16"]
    assert "torchao" in reason(H100, "fp8", torchao=False)
    assert enabled(H100, torchao=True)["fp8"]


def frontend_update(widget, **state):
    """Apply a state change the way a frontend's comm message does."""
    widget._handle_msg({"content": {"data": {"method": "update", "state": state}}, "buffers": []})


def frontend_click(button):
    button._handle_msg(
        {"content": {"data": {"method": "custom", "content": {"event": "click"}}}, "buffers": []}
    )


def test_panel_edits_live_config_and_saves_yaml(tmp_path):
    path = tmp_path / "cfg.yaml"
    cfg = LaunchConfig()
    panel = ConfigPanel(cfg, A100, path, torchao=False)
    assert cfg.num_processes == 2  # one per GPU shown, and that is what the config holds
    frontend_update(panel.num_processes, value=1)
    frontend_update(panel.precision["bf16"], value=True)
    frontend_update(panel.strategy, index=1)
    frontend_update(panel.gradient_accumulation_steps, value=4)
    assert (cfg.num_processes, cfg.mixed_precision, cfg.strategy) == (1, "bf16", "fsdp")
    assert cfg.gradient_accumulation_steps == 4
    assert [k for k, b in panel.precision.items() if b.value] == ["bf16"]  # a radio group

    # fp8 is disabled here (compute capability 8.0): selecting it changes nothing.
    assert panel.precision["fp8"].disabled and "8.9" in panel.precision_reasons.value
    frontend_update(panel.precision["fp8"], value=True)
    assert cfg.mixed_precision == "bf16" and not panel.precision["fp8"].value
    frontend_update(panel.num_processes, value=64)  # more than the GPUs: clamped
    assert cfg.num_processes == 2

    frontend_click(panel.save_button)
    assert str(path) in panel.status.value
    saved = LaunchConfig.load(path)
    assert saved == cfg
    assert "mixed_precision: bf16" in path.read_text() and "strategy: fsdp" in path.read_text()


def test_saved_precision_this_machine_cannot_run_falls_back(tmp_path):
    path = tmp_path / "cfg.yaml"
    LaunchConfig(mixed_precision="bf16", num_processes=1).save(path)
    cfg = LaunchConfig.load(path)
    panel = ConfigPanel(cfg, T4, path)
    assert cfg.mixed_precision == "no" and panel.precision["no"].value
    assert "cannot run here" in panel.status.value


def test_text_form_where_widgets_cannot_render(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("NBACCEL_VIEW", "text")
    path = tmp_path / "cfg.yaml"
    LaunchConfig(num_processes=2, strategy="fsdp").save(path)
    cfg = configure(path)
    out = capsys.readouterr().out
    assert cfg.num_processes == 2 and cfg.strategy == "fsdp"
    assert "CPU:" in out and "mixed_precision:" in out and "(fp8: fp8 needs" in out


@pytest.fixture(scope="module")
def kernel():
    with KernelSession(env={"NBACCEL_VIEW": "widgets"}, background_shutdown=True) as k:
        yield k


@pytest.mark.slow
def test_panel_in_a_real_kernel_via_comm_messages(kernel, tmp_path):
    path = tmp_path / "default.yaml"
    cell = kernel.execute(f"import nbaccel\ncfg = nbaccel.configure({str(path)!r})")
    assert cell.error is None, cell.error_text
    comms: dict[str, dict] = {}  # each widget's state as a frontend rebuilds it
    for m in cell.of_type("comm_open", "comm_msg"):
        data = m["content"]["data"]
        if m["msg_type"] == "comm_open" or data.get("method") == "update":
            comms.setdefault(m["content"]["comm_id"], {}).update(data.get("state", {}))
    hardware = next(s["value"] for s in comms.values() if "nbaccel-hardware" in str(s.get("value")))
    assert re.search(r"CPU: \d+ core", hardware)

    def comm(model, description):
        return next(
            cid
            for cid, s in comms.items()
            if s.get("_model_name") == model
            and (
                s.get("description") == description
                or f"nbaccel-{description}" in s.get("_dom_classes", ())
            )
        )

    def send(comm_id, data):
        client = kernel.client
        client.shell_channel.send(
            client.session.msg("comm_msg", {"comm_id": comm_id, "data": data})
        )

    send(comm("ToggleButtonModel", "bf16"), {"method": "update", "state": {"value": True}})
    send(comm("BoundedIntTextModel", "processes"), {"method": "update", "state": {"value": 1}})
    send(
        comm("ButtonModel", "save as default"), {"method": "custom", "content": {"event": "click"}}
    )
    cell = kernel.execute("print(cfg.mixed_precision, cfg.num_processes)")
    assert cell.stdout.split() == ["bf16", "1"]
    assert "mixed_precision: bf16" in path.read_text()
    assert "num_processes: 1" in path.read_text()

    # Two-way: a change made in code shows in the form once the cell has run.
    cell = kernel.execute("cfg.num_processes = 2\ncfg.mixed_precision = 'fp16'")
    assert cell.error is None, cell.error_text
    updates = {}
    for m in cell.of_type("comm_msg"):
        data = m["content"]["data"]
        if data.get("method") == "update":
            updates.setdefault(m["content"]["comm_id"], {}).update(data["state"])
    assert updates[comm("BoundedIntTextModel", "processes")]["value"] == 2
    assert updates[comm("ToggleButtonModel", "fp16")]["value"] is True
    assert updates[comm("ToggleButtonModel", "bf16")]["value"] is False


def test_labels_are_whole_and_in_one_column():
    panel = ConfigPanel(LaunchConfig(), A100, "/nonexistent/cfg.yaml", torchao=False)
    rows = [c for c in panel.widget.children if c.__class__.__name__ == "HBox"][:4]
    labels = [row.children[0] for row in rows]
    assert [label.value for label in labels] == [
        "processes",
        "mixed precision",
        "strategy",
        "gradient accumulation steps",
    ]
    assert {label.layout.width for label in labels} == {"15em"}
    controls = [panel.num_processes, panel.strategy, panel.gradient_accumulation_steps]
    assert all(not c.description for c in controls)  # no second, truncating label


def test_sync_shows_programmatic_changes():
    cfg = LaunchConfig()
    panel = ConfigPanel(cfg, A100, "/nonexistent/cfg.yaml", torchao=False)
    cfg.num_processes, cfg.strategy, cfg.mixed_precision = 1, "fsdp", "bf16"
    cfg.gradient_accumulation_steps = 8
    panel.sync()
    assert panel.num_processes.value == 1 and panel.strategy.value == "fsdp"
    assert panel.gradient_accumulation_steps.value == 8
    assert [k for k, b in panel.precision.items() if b.value] == ["bf16"]
