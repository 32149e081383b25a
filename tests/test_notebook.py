"""notebooks/quickstart.ipynb runs top to bottom, and each of its plots is a real, non-blank figure."""

import base64
import io
import os

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
plt = pytest.importorskip("matplotlib.pyplot")

NOTEBOOK = os.path.join(os.path.dirname(__file__), "..", "notebooks", "quickstart.ipynb")


@pytest.mark.heavy
def test_quickstart_executes_and_draws_four_real_figures(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError, naming the cell, if any cell fails (its asserts included)
    images = [out["data"]["image/png"] for cell in nb.cells if cell.cell_type == "code"
              for out in cell.get("outputs", []) if "image/png" in out.get("data", {})]
    assert len(images) == 4
    for png in images:
        pixels = plt.imread(io.BytesIO(base64.b64decode(png)))
        assert pixels.shape[0] > 100 and pixels.shape[1] > 200
        assert pixels[..., :3].std() > 0.05  # not a blank canvas
    text = "".join(out.get("text", "") for cell in nb.cells for out in cell.get("outputs", []))
    assert "tokens generated" in text and "bytes per token of context" in text
