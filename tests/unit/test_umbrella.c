/* include/apiary/apiary.h includes every public header: a program that
 * includes it alone sees the whole API. */
#include "aptest.h"
#include "apiary/apiary.h"

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void test_every_header_included(void **state)
{
    (void)state;
    const char *src = getenv("APIARY_SRC");
    if (!src) skip();
    char dir[2048], path[4096];
    snprintf(dir, sizeof dir, "%s/include/apiary", src);
    snprintf(path, sizeof path, "%s/apiary.h", dir);
    char *umbrella = ap_test_read_file(path, NULL);
    assert_non_null(umbrella);
    DIR *d = opendir(dir);
    assert_non_null(d);
    int headers = 0;
    for (struct dirent *e; (e = readdir(d));) {
        size_t n = strlen(e->d_name);
        if (n < 3 || strcmp(e->d_name + n - 2, ".h") != 0 || strcmp(e->d_name, "apiary.h") == 0)
            continue;
        char line[300];
        snprintf(line, sizeof line, "#include \"apiary/%s\"", e->d_name);
        if (!strstr(umbrella, line)) fail_msg("apiary.h does not include %s", e->d_name);
        headers++;
    }
    closedir(d);
    free(umbrella);
    assert_true(headers > 10);
}

/* The umbrella compiles into a program: one symbol from a few of its parts. */
static void test_symbols_visible(void **state)
{
    (void)state;
    assert_string_equal(ap_version(), AP_VERSION_STRING);
    assert_non_null(ap_err_name(AP_EINVAL));
    assert_non_null(ap_codec_name(AP_CODEC_FP16));
    assert_non_null((void *)ap_dht_config_default);
    assert_non_null((void *)ap_sim_new);
    assert_non_null((void *)ap_node_call_sync);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_header_included),
        cmocka_unit_test(test_symbols_visible),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
