/*
 * moectl: the command-line client of moed.
 *
 *   moectl [-r DIR] ping [--count N] [--interval-us U]
 *   moectl [-r DIR] info
 *   moectl [-r DIR] layers
 *   moectl [-r DIR] load NAME (--file F [--prefix P] | --random [--seed S])
 *                             [--dtype bf16|fp16|fp32]
 *                             MoE: [--topk K] [--experts E] [--hidden H] [--intermediate I]
 *                             [--routing softmax|sigmoid|given] [--no-renormalize]
 *                             [--devices 0,1] [--placement D,...]
 *                             --kind gemm: [--groups G] [--n N] [--k K]
 *   moectl [-r DIR] unload NAME
 *   moectl [-r DIR] forward --layer L (--tokens T | --input F) [--output F] [--check]
 *                           [--seed S] [--repeat N]
 *   moectl [-r DIR] gemm --layer L --rows M [--check] [--seed S]
 *   moectl [-r DIR] stats [--json]
 *   moectl [-r DIR] bench [--layer L] [--clients N] [--tokens T] [--seconds S] [--json]
 *                         [--no-batch] [--client-spin-us U] [--client-spin-ahead-us A]
 *   moectl zmq-rtt [--count N]
 *
 * Exit status: 0 success, 1 a failed operation or a check past tolerance,
 * 2 bad usage.
 */
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client/moectl.h"
#include "moe.h"

static void usage(FILE *f)
{
    fprintf(f,
            "usage: moectl [-r RUNTIME_DIR] COMMAND [options]\n\n"
            "commands:\n"
            "  ping [-n|--count N] [--interval-us U]\n"
            "                               round trips to the daemon (U us apart), p50/p99 latency\n"
            "  info                         daemon version, backend, devices, capabilities\n"
            "  layers                       the loaded layers\n"
            "  load NAME (--file F [--prefix P] | --random [--seed S]) [--dtype bf16|fp16|fp32]\n"
            "       a MoE layer: [--topk K] [--experts E] [--hidden H] [--intermediate I]\n"
            "       [--routing softmax|sigmoid|given] [--no-renormalize] [--devices 0,1]\n"
            "       [--placement DEVICE_OF_EACH_EXPERT,...]\n"
            "       a GEMM layer: --kind gemm [--groups G] [--n N] [--k K] (--prefix: its tensor)\n"
            "                               load a layer from a safetensors file, or upload\n"
            "                               random weights of the given shape\n"
            "  unload NAME                  unload a layer\n"
            "  forward --layer L (--tokens T | --input F) [--output F] [--check] [--seed S] [--repeat N]\n"
            "                               one MoE forward pass on random or given inputs\n"
            "  gemm --layer L --rows M [--check] [--seed S]\n"
            "                               one grouped GEMM on random rows\n"
            "  stats [--json]               the daemon's counters\n"
            "  bench [--layer L] [--clients N] [--tokens T] [--seconds S] [--json] [--no-batch]\n"
            "        [--client-spin-us U] [--client-spin-ahead-us A]\n"
            "                               N client processes sending requests back to back\n"
            "                               (each busy-polls up to U us for its reply, or from A us\n"
            "                               before to A us after the time its replies take)\n"
            "  zmq-rtt [-n|--count N]       bare ZeroMQ round trips between two processes, no daemon\n\n"
            "The runtime directory defaults to $MOED_RUNTIME_DIR, /run/moed as root,\n"
            "else $XDG_RUNTIME_DIR/moed, else /tmp/moed-UID.\n");
}

int main(int argc, char **argv)
{
    const char *rt = NULL;
    int i = 1;
    while (i < argc && argv[i][0] == '-') {
        if (!strcmp(argv[i], "-r") || !strcmp(argv[i], "--runtime-dir") ||
            !strncmp(argv[i], "--runtime-dir=", 14)) {
            const char *opt = argv[i][1] == 'r' ? "-r" : "--runtime-dir";
            if (argv[i][1] == '-' && argv[i][13] == '=') {
                rt = argv[i] + 14;
                i++;
            } else {
                rt = i + 1 < argc ? argv[i + 1] : NULL;
                i += 2;
            }
            /* Empty, libmoe would look for the socket at /moed.sock. */
            if (!rt || !rt[0]) {
                fprintf(stderr, "moectl: %s needs a runtime directory\n", opt);
                return 2;
            }
        } else if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(argv[i], "-V") || !strcmp(argv[i], "--version")) {
            printf("moectl %s\n", MOE_VERSION);
            return 0;
        } else {
            fprintf(stderr, "moectl: unknown option %s\n", argv[i]);
            usage(stderr);
            return 2;
        }
    }
    if (i >= argc) {
        usage(stderr);
        return 2;
    }
    static const struct {
        const char *name;
        int (*fn)(const char *rt, int argc, char **argv);
    } cmds[] = {
        {"ping", cmd_ping},       {"info", cmd_info},     {"layers", cmd_layers},
        {"load", cmd_load},       {"unload", cmd_unload}, {"forward", cmd_forward},
        {"gemm", cmd_gemm},       {"stats", cmd_stats},   {"bench", cmd_bench},
        {"zmq-rtt", cmd_zmq_rtt},
    };
    for (size_t c = 0; c < sizeof(cmds) / sizeof(cmds[0]); c++)
        if (!strcmp(argv[i], cmds[c].name)) {
            /* getopt_long's messages begin with argv[0]: "moectl ping:",
             * not a bare "ping:" that reads as another program's. */
            static char name[32];
            snprintf(name, sizeof(name), "moectl %s", cmds[c].name);
            argv[i] = name;
            optind = 1;
            return cmds[c].fn(rt, argc - i, argv + i);
        }
    fprintf(stderr, "moectl: unknown command '%s'\n", argv[i]);
    usage(stderr);
    return 2;
}
