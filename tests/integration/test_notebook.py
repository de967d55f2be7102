"""docs/notebook.ipynb runs top to bottom on CPU: proc meshes by hand, a vLLM generator, a trainer,
GRPO steps driven from the notebook, a reward plot, and the same actors as a service that the
tinker SDK trains a LoRA tenant on."""

from __future__ import annotations

import ast
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
NOTEBOOK = REPO / "docs" / "notebook.ipynb"


def test_the_notebook_drives_grpo_by_hand_and_plots_the_reward():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(REPO)}})
    client.execute()  # nbclient's per-cell timeout (300 s) bounds a hung cell; speed is not tested here

    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    assert [o for o in outputs if o.output_type == "error"] == []
    assert any("image/png" in o.get("data", {}) for o in outputs), "the reward plot is missing"
    summary = ast.literal_eval(notebook.cells[-1].outputs[-1]["data"]["text/plain"])
    assert summary["steps"] == 60
    assert summary["policy_version"] == 61  # the step by hand, then the loop's 60
    assert summary["last_rewards"] > summary["first_rewards"] + 0.1, summary
    sevens_before, sevens_after = summary["sevens_before_after"]  # of 16 samples of "M37="
    assert sevens_after >= 12 and sevens_after > sevens_before, summary
    assert summary["service_requests"] > 40, summary
