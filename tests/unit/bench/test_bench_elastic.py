"""`forge-rl bench elastic`'s refusals (no run); tests/integration/test_bench_elastic.py runs it on real engines."""

from pathlib import Path

import pytest

from forge_rl.bench.elastic import ElasticArgs, main
from forge_rl.errors import ConfigError

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("counts, steps", [((8, 0), 10), ((), 10), ((8, 4), 1)])
def test_counts_below_one_or_phases_too_short_are_refused(counts, steps, tmp_path):
    with pytest.raises(ConfigError, match="--counts .* --steps-per-phase"):
        main(
            ElasticArgs(config=REPO / "configs/sim_scale.yaml", counts=counts, steps_per_phase=steps, out_dir=tmp_path)
        )
