"""An error's kind is data that crosses every process boundary: a refused weight push is
"refused" (nothing changed, the group still usable) from the worker that refused it to the
trainer, whatever text it carries; a plain bad input stays "invalid"."""

import asyncio

import pytest

from engine.errors import EngineUnhealthyError, RefusedError
from engine.messages import FAILED, INVALID, REFUSED, UNHEALTHY, error_for, error_kind
from rollout import protocol as P
from weight_sync.common.votes import PushRefused, WeightSyncError
from weight_sync.engine_side.engines import commit_results


@pytest.mark.parametrize("error,kind", [
    (PushRefused("layout differs"), REFUSED),
    (ValueError("max_tokens must be >= 1"), INVALID),
    (RuntimeError("boom"), FAILED),
])
def test_a_kind_survives_the_engine_boundary(error, kind):
    assert error_kind(error) == kind
    again = error_for(kind, str(error))
    assert error_kind(again) == kind and str(again) == str(error)
    assert isinstance(again, ValueError) == (kind in (REFUSED, INVALID))  # a refusal is bad input too
    assert P.error_kind(again) == kind  # and the sidecar's reply says the same


def test_unhealthy_comes_back_as_an_unhealthy_engine():
    assert isinstance(error_for(UNHEALTHY, "torn"), EngineUnhealthyError)


class _Engine:
    """What commit_results calls on the engines that committed (none here)."""

    async def reset_prefix_cache(self):
        raise AssertionError("no engine committed")

    set_weight_version = reset_prefix_cache


def test_a_push_is_refused_only_when_every_engine_refused_it():
    engines = [_Engine(), _Engine()]
    with pytest.raises(WeightSyncError) as refused:
        asyncio.run(commit_results(engines, [RefusedError("a"), RefusedError("b")], 3))
    assert refused.value.refused
    with pytest.raises(WeightSyncError) as failed:  # a ValueError that is no refusal: something may have changed
        asyncio.run(commit_results(engines, [RefusedError("a"), ValueError("b")], 3))
    assert not failed.value.refused
