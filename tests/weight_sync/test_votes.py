"""The votes every rank casts (weight_sync.common.votes), on a real gloo group of threads."""

import pytest

from tests.weight_sync.test_group import _form, _run
from weight_sync.common.votes import VOTE_OK, VOTE_REFUSED, VOTE_STALE, commit_vote, manifest_vote

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def ranks():
    master, res = _form(3, timeout_s=10.0)
    groups = [master, *res[1:]]
    yield groups
    for g in groups:
        g.close()


def _vote(ranks, statuses, digests):
    return _run([lambda g=g, s=s, d=d: manifest_vote(g, s, d) for g, s, d in zip(ranks, statuses, digests)])


def test_every_rank_accepting_one_manifest_is_ok_everywhere(ranks):
    verdicts = _vote(ranks, [VOTE_OK] * 3, [1234] * 3)
    assert all(v.ok and v.same_manifest and v.worst == VOTE_OK for v in verdicts)


def test_the_worst_status_wins_on_every_rank(ranks):
    verdicts = _vote(ranks, [VOTE_STALE, VOTE_OK, VOTE_REFUSED], [7] * 3)
    assert [v.worst for v in verdicts] == [VOTE_STALE] * 3 and not any(v.ok for v in verdicts)


def test_ranks_holding_different_manifests_all_see_it(ranks):
    verdicts = _vote(ranks, [VOTE_OK] * 3, [5, 5, -9])  # a negative digest too: max and -max both checked
    assert not any(v.same_manifest or v.ok for v in verdicts)


def test_the_commit_vote_passes_only_when_every_digest_is_the_trainers(ranks):
    assert _run([lambda g=g: commit_vote(g, 42) for g in ranks]) == [[]] * 3
    # rank 2 staged other bytes: every rank learns which one, so none commits
    assert _run([lambda g=g, d=d: commit_vote(g, d) for g, d in zip(ranks, [42, 42, 43])]) == [[2]] * 3
    # the trainer's digest is the reference: when it differs, every worker is named
    assert _run([lambda g=g, d=d: commit_vote(g, d) for g, d in zip(ranks, [1, 42, 42])]) == [[1, 2]] * 3


def test_one_worker_votes_too(ranks):
    master, res = _form(2, timeout_s=5.0)
    try:  # a lone worker has no peer to agree with, but the trainer's digest to match
        assert _run([lambda: commit_vote(master, 5), lambda: commit_vote(res[1], 6)]) == [[1], [1]]
    finally:
        master.close()
        res[1].close()
