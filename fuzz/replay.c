/* Replays fuzz inputs through a libFuzzer target built with any compiler:
 * `replay_NAME FILE_OR_DIR...` feeds every file (a directory's entries in
 * name order) to LLVMFuzzerTestOneInput once. Exit 0 when every input ran,
 * 1 when an argument could not be read or no input was found. A crash or a
 * sanitizer report on an input fails the run as it would under the fuzzer. */
#include <dirent.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define REPLAY_MAX_INPUT (64u << 20) /* far above any seed; a cap before malloc */

static int replay_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "replay: cannot open %s\n", path);
        return -1;
    }
    struct stat st;
    if (fstat(fileno(f), &st) != 0 || st.st_size < 0 || (uint64_t)st.st_size > REPLAY_MAX_INPUT) {
        fprintf(stderr, "replay: %s: unreadable or over %u bytes\n", path, REPLAY_MAX_INPUT);
        fclose(f);
        return -1;
    }
    size_t n = (size_t)st.st_size;
    uint8_t *buf = malloc(n ? n : 1);
    if (!buf || fread(buf, 1, n, f) != n) {
        fprintf(stderr, "replay: cannot read %s\n", path);
        free(buf);
        fclose(f);
        return -1;
    }
    fclose(f);
    /* an exact-size copy, so reads past the end are caught under ASan */
    uint8_t *in = malloc(n ? n : 1);
    if (!in) {
        free(buf);
        return -1;
    }
    memcpy(in, buf, n);
    free(buf);
    LLVMFuzzerTestOneInput(n ? in : NULL, n);
    free(in);
    return 0;
}

static int by_name(const struct dirent **a, const struct dirent **b)
{
    return strcmp((*a)->d_name, (*b)->d_name);
}

static int replay_dir(const char *dir, size_t *count)
{
    struct dirent **ents;
    int n = scandir(dir, &ents, NULL, by_name);
    if (n < 0) {
        fprintf(stderr, "replay: cannot list %s\n", dir);
        return -1;
    }
    int rc = 0;
    for (int i = 0; i < n; i++) {
        char path[4096];
        struct stat st;
        if (ents[i]->d_name[0] != '.' &&
            snprintf(path, sizeof path, "%s/%s", dir, ents[i]->d_name) < (int)sizeof path &&
            stat(path, &st) == 0 && S_ISREG(st.st_mode)) {
            if (replay_file(path) != 0)
                rc = -1;
            else
                (*count)++;
        }
        free(ents[i]);
    }
    free(ents);
    return rc;
}

int main(int argc, char **argv)
{
    size_t count = 0;
    int rc = 0;
    for (int i = 1; i < argc; i++) {
        struct stat st;
        if (stat(argv[i], &st) != 0) {
            fprintf(stderr, "replay: no such file or directory: %s\n", argv[i]);
            rc = -1;
        } else if (S_ISDIR(st.st_mode)) {
            if (replay_dir(argv[i], &count) != 0) rc = -1;
        } else if (replay_file(argv[i]) != 0) {
            rc = -1;
        } else {
            count++;
        }
    }
    printf("replayed %zu inputs\n", count);
    return rc == 0 && count > 0 ? 0 : 1;
}
