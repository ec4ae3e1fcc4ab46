/*
 * fuzz_config.c: libFuzzer target for the configuration parser (INI through
 * inih, then moed's own keys, numbers and layer sections). A configuration
 * that parses must hold values inside the documented bounds; every one,
 * parsed or refused, must come with no leak and, when refused, a message.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/config.h"
#include "daemon/util.h"
#include "tests/fuzz/fuzz.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *text = malloc(size + 1);
    if (!text)
        return 0;
    memcpy(text, data, size);
    text[size] = '\0';
    struct config c;
    char err[512] = "";
    FUZZ_CHECK(config_init(&c) == 0, "config_init");
    int rc = config_parse_string(&c, text, err, sizeof(err));
    if (rc == 0) {
        FUZZ_CHECK(c.max_batch_tokens >= 1 && c.max_slice_tokens >= 1 &&
                       c.max_request_tokens >= 1 && c.max_sessions >= 1 && c.max_regions >= 1 &&
                       c.max_queued_requests >= 1 && c.max_queued_total >= 1 &&
                       c.max_message_bytes >= 4096 && c.max_layers >= 1 && c.max_loads >= 1,
                   "a limit below its minimum");
        FUZZ_CHECK(c.runtime_dir && c.runtime_dir[0] == '/', "runtime_dir");
        for (size_t i = 0; i < c.n_allowed_dirs; i++)
            FUZZ_CHECK(c.allowed_dirs[i][0] == '/', "allowed dir %s", c.allowed_dirs[i]);
        for (struct layer_conf *l = c.layers; l; l = l->next)
            FUZZ_CHECK(name_valid(l->name) && l->path, "layer %s", l->name);
    } else {
        FUZZ_CHECK(err[0] != '\0' || rc == -ENOMEM, "refused (%d) without a message", rc);
    }
    config_done(&c);
    free(text);
    return 0;
}
