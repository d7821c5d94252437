"""An error's kind is data that crosses every process boundary: a refused weight push is
"refused" (nothing changed, the group still usable) from the worker that refused it to the
trainer, whatever text it carries; a plain bad input stays "invalid"."""

import asyncio

import pytest

from engine.errors import FAILED, INVALID, REFUSED, UNHEALTHY, EngineUnhealthyError, RefusedError, error_kind
from engine.messages import error_for
from rollout.client.sidecar_link import SidecarError, SidecarGoneError
from rollout.sidecar.push_coordinator import PushWithdrawn, WeightSyncRefused, WeightSyncRegroup
from rollout.sidecar.supervision import NoEngineError
from weight_sync.common.votes import (
    DeltaBaseError, NeedsBaseError, PushRefused, StaleManifestError, WeightSyncError, WeightSyncRefusedError,
)
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


@pytest.mark.parametrize("kind", [PushRefused, WeightSyncRefusedError, StaleManifestError, NeedsBaseError,
                                  DeltaBaseError, WeightSyncRefused, PushWithdrawn])
def test_every_refusal_stems_from_the_one_root_and_reads_refused(kind):
    error = kind("nothing changed")
    assert isinstance(error, RefusedError) and error.refused and error_kind(error) == REFUSED


def test_the_sidecars_kinds_are_read_by_the_same_reader():
    assert error_kind(WeightSyncRegroup("an engine restarted")) == "regroup"
    assert error_kind(NoEngineError("no engine left")) == "gone"
    assert error_kind(SidecarGoneError("tcp://x:1", "closed")) == "gone"
    assert error_kind(SidecarError("refused by the sidecar", "refused")) == REFUSED
    assert error_kind(SidecarError("no word from the sidecar")) == FAILED
    assert error_kind(PermissionError("bad token")) == INVALID
    failed = WeightSyncError("the transfer broke")
    assert not failed.refused and error_kind(failed) == FAILED


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
