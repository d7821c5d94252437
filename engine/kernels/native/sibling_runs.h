/* Which rows of a paged_decode.c call a thread takes together (sibling runs, and the blocks a run's rows
   share: a tile's), and in what order. Included by paged_decode.c after Call and Tile. */
#ifndef ROLLOUT_NATIVE_SIBLING_RUNS_H
#define ROLLOUT_NATIVE_SIBLING_RUNS_H

/* Sibling runs (paged_decode.c's MAX_RUN): adjacent rows whose first cache block is the same one are the n
   samples of one prompt (prefix caching gave them its blocks; the batch, sorted by length, keeps them
   together), or the rows of one prompt's prefill. One thread takes a run as a tile (paged_decode.c's Tile)
   over the blocks every row of it reads whole; before (row after row, finding the shared blocks in L2
   after the first row) a 256-row GRPO-shaped step of SmolLM2 took 5-7% less time than rows taken apart. A
   run is cut at MAX_RUN rows so that rows which all share one system prompt still spread over the threads. */

/* A sibling run: rows [first, end), `keys` keys in all (its cost), the leading blocks its rows attend
   together as a tile (shared_blocks; 0: row after row). */
typedef struct {
    int64_t first, end, keys, shared;
} Run;

static int more_keys_first(const void *a, const void *b) {
    const Run *x = a, *y = b;
    if (x->keys != y->keys) return x->keys < y->keys ? 1 : -1;
    return (x->first > y->first) - (x->first < y->first);
}

/* The sibling runs of the B rows, `count` of them, the costliest first: handed out in that order the
   last runs are short ones, so no thread waits long for another at the end (a 32-row step's few runs
   differ in keys by up to 8x: taken in row order, one thread often had the two longest; a step of
   Qwen3-1.7B's attention 1.19x faster at 32 rows, 1.11x at 256). malloc'd; NULL when out of memory. */
static Run *sibling_runs(const int64_t *table, int64_t table_stride, const int64_t *lengths, int64_t B,
                         int64_t window, int64_t bs, int64_t *count) {
    Run *runs = malloc(sizeof(Run) * (size_t)(B + 1));
    if (runs == NULL) return NULL;
    *count = 0;
    int64_t previous = -1; /* the first block the row before reads (under a window: its window's first) */
    for (int64_t b = 0; b < B; b++) {
        Run *last = *count ? runs + *count - 1 : NULL;
        const int64_t start = window_start(lengths[b], window), keys = lengths[b] - start;
        const int64_t first = table[b * table_stride + start / bs]; /* not a spare block behind the window */
        if (last == NULL || b - last->first >= MAX_RUN || first != previous)
            runs[(*count)++] = (Run){b, b + 1, keys, 0};
        else
            last->end = b + 1, last->keys += keys;
        previous = first;
    }
    qsort(runs, (size_t)*count, sizeof(Run), more_keys_first);
    return runs;
}

/* How many leading blocks the rows [b0, end) all read whole from the same cache blocks (a tile's
   `shared`): 0 where a window cuts a row (its first block is its own) or a block is not a whole
   number of groups of four slots. */
static int64_t shared_blocks(const Call *c, int64_t b0, int64_t end) {
    if (end - b0 < 2 || c->bs % 4) return 0;
    int64_t shared = INT64_MAX, longest = 0;
    for (int64_t b = b0; b < end; b++) {
        if (window_start(c->lengths[b], c->window)) return 0;
        shared = min64(shared, c->lengths[b] / c->bs), longest = c->lengths[b] > longest ? c->lengths[b] : longest;
    }
    const int64_t *first = c->table + b0 * c->table_stride, blocks = (longest + c->bs - 1) / c->bs;
    for (int64_t b = b0 + 1; b < end; b++)
        if (memcmp(c->table + b * c->table_stride, first, sizeof(int64_t) * (size_t)blocks)) return 0;
    return shared;
}

#endif
