/*
 * fuzz.h: what the fuzz targets and the seed generator (gen_corpus.c) agree
 * on: the request target's session token and region ids, the layout of its
 * region, the layers it serves, and the framing of its inputs; and every
 * target's check (FUZZ_CHECK).
 *
 * fuzz_request's input, by its first byte (mod FUZZ_MODES):
 *   0        one whole Request envelope, as the ROUTER would receive it;
 *   1 .. 7   the body of one message type (Request fields 10 .. 16: Hello,
 *            LoadLayer, UnloadLayer, ListLayers, FusedMoe, GroupedGemm,
 *            GetStats), wrapped in an envelope with the session's token, so
 *            that the fuzzer spends its time past authentication;
 *   8        session-socket messages on a new session: records of
 *            [length][flags][bytes]; flags bit 0 attaches a memfd of
 *            4096 << (flags >> 2 & 3) bytes, bit 1 seals it as required;
 *   9        several envelopes at once (records of [length lo][length hi]
 *            [bytes]), all submitted before the daemon runs any, so they
 *            queue, batch, expire and get cancelled together.
 */
#ifndef MOE_FUZZ_H
#define MOE_FUZZ_H

#include <stdio.h>
#include <stdlib.h>

/* A property every input must keep: on failure, say which and where, then
 * abort so libFuzzer saves the input. */
#define FUZZ_CHECK(cond, ...)                                                  \
    do {                                                                       \
        if (!(cond)) {                                                         \
            fprintf(stderr, "%s:%d: %s: ", __FILE__, __LINE__, #cond);         \
            fprintf(stderr, __VA_ARGS__);                                      \
            fputc('\n', stderr);                                               \
            abort();                                                           \
        }                                                                      \
    } while (0)

#define FUZZ_MODES 10
enum {
    FUZZ_MODE_ENVELOPE = 0,
    FUZZ_MODE_SESSION = 8,
    FUZZ_MODE_MULTI = 9,
};

/* The fuzzed session's token (16 bytes) and region; another session's
 * region, which no input may change. */
#define FUZZ_TOKEN "fuzz-token-0123!"
#define FUZZ_OTHER_TOKEN "other-token-456!"
#define FUZZ_REGION 1
#define FUZZ_OTHER_REGION 2
#define FUZZ_REGION_BYTES 65536

/* Layout of the fuzzed session's region, reset before every input. */
#define FUZZ_OFF_I32 0x0000  /* int32 i % 4: valid ids for 4 experts */
#define FUZZ_OFF_I64 0x4000  /* int64 i % 4 */
#define FUZZ_OFF_F32 0x6000  /* fp32 in [0.25, 1) */
#define FUZZ_OFF_BF16 0x8000 /* bf16 in [-1, 1) */
#define FUZZ_OFF_OUT 0xa000  /* pseudo-random bytes; outputs go here */

/* Layers, all loaded from FUZZ_DIR/weights.safetensors:
 *   moe    E=4 k=2 H=8 I=16 bf16, softmax, renormalised (tensors "a.")
 *   given  the same weights, given routing
 *   moe32  E=4 k=1 H=8 I=16 fp32, sigmoid (tensors "b.")
 *   gemm   B [3, 8, 8] bf16 (tensor "g.weight") */
#define FUZZ_DIR "/tmp/moed-fuzz"
#define FUZZ_WEIGHTS FUZZ_DIR "/weights.safetensors"
#define FUZZ_E 4
#define FUZZ_H 8
#define FUZZ_I 16
#define FUZZ_G 3
#define FUZZ_N 8
#define FUZZ_K 8

#endif
