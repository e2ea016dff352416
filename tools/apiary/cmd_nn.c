/* `apiary nn-train`: single-process trainer of the model kit's GPT on a text
 * file, for debugging models and data (the collaborative trainer is
 * `apiary train`). Shows a one-line status, saves/resumes checkpoints, and
 * samples text at the end. */
#include "cli.h"

#include "apiary/error.h"
#include "apiary/log.h"
#include "apiary/nn.h"

#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void usage(FILE *f)
{
    fprintf(f,
            "usage: apiary nn-train [options]\n\n"
            "Trains the byte-level GPT of the model kit on a text file, in this process.\n\n"
            "  --data FILE        text to train on (default: the shipped corpus %s)\n"
            "  --layers N         transformer blocks (4)      --embd C   width (128)\n"
            "  --heads N          attention heads (4)         --ctx T    context (64)\n"
            "  --batch B          sequences per step (16)     --steps N  steps (200)\n"
            "  --optim NAME       adamw|adam|sgd|lamb (adamw) --lr X     peak rate (1e-3)\n"
            "  --schedule NAME    cosine|linear|constant|rsqrt (cosine)  --warmup N (20)\n"
            "  --clip X           global gradient-norm clip (1.0; 0 = off)\n"
            "  --dropout P        residual dropout (0)        --share-layers  ALBERT-style\n"
            "  --seed N           init, data order and dropout seed (1)\n"
            "  --save FILE        checkpoint at the end (and every --save-every steps)\n"
            "  --save-every N     (0 = only at the end)\n"
            "  --resume FILE      start from a checkpoint of the same model and optimizer\n"
            "  --sample N         print N sampled bytes at the end (200)\n"
            "  --log-level LEVEL  debug|info|warn|error|off\n",
            ap_nn_default_corpus());
}

/* Writes seed files for fuzz/fuzz_checkpoint.c (selector byte + file). */
static int write_fuzz_corpus(const char *dir)
{
    ap_nn_gpt_config_t gc = ap_nn_gpt_config_default(4, 1, 1, 4, 1);
    gc.vocab = 8;
    ap_nn_mlp_config_t mc = {
        .in_dim = 3, .n_hidden = 1, .hidden = {4}, .n_classes = 2, .max_batch = 1};
    ap_nn_model_t *g = NULL, *m = NULL;
    ap_nn_solver_t *o = NULL;
    int rc = ap_nn_gpt_new(&gc, &g);
    if (!rc) rc = ap_nn_mlp_new(&mc, &m);
    if (!rc) {
        ap_nn_params_t *p = ap_nn_model_params(g);
        ap_nn_solver_config_t oc = ap_nn_solver_defaults(AP_NN_ADAMW);
        rc = ap_nn_solver_new(&oc, p->count, p->views, p->nviews, &o);
    }
    if (rc) goto out;
    ap_nn_model_init(g, 1);
    ap_nn_model_init(m, 1);
    for (size_t i = 0; i < o->state_count; i++) o->state[i] = (float)i * 1e-3f;
    mkdir(dir, 0755);
    struct {
        const char *name;
        uint8_t sel;
        ap_nn_model_t *model;
        ap_nn_solver_t *opt;
    } seeds[] = {{"gpt_adamw", 0, g, o},
                 {"gpt_weights", 1, g, NULL},
                 {"mlp", 2, m, NULL},
                 {"gpt_adamw_fixsum", 4, g, o},
                 {"mlp_fixsum", 6, m, NULL}};
    for (size_t i = 0; i < sizeof seeds / sizeof seeds[0] && !rc; i++) {
        uint8_t *buf;
        size_t len;
        if ((rc = ap_nn_checkpoint_encode(seeds[i].model, seeds[i].opt, 42, &buf, &len))) break;
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, seeds[i].name);
        FILE *f = fopen(path, "wb");
        if (!f || fwrite(&seeds[i].sel, 1, 1, f) != 1 || fwrite(buf, 1, len, f) != len) rc = AP_EIO;
        if (f && fclose(f) != 0) rc = AP_EIO;
        free(buf);
    }
out:
    ap_nn_solver_free(o);
    ap_nn_model_free(g);
    ap_nn_model_free(m);
    if (rc) fprintf(stderr, "apiary nn-train: fuzz corpus: %s\n", ap_strerror(rc));
    return rc ? 1 : 0;
}

static int nn_train_main(int argc, char **argv)
{
    const char *data = NULL, *save = NULL, *resume = NULL;
    int layers = 4, embd = 128, heads = 4, ctx = 64, batch = 16, steps = 200, warmup = 20,
        sample = 200, save_every = 0;
    float lr = 1e-3f, clip = 1.0f, dropout = 0.0f;
    bool share = false;
    uint64_t seed = 1;
    ap_nn_solver_kind_t okind = AP_NN_ADAMW;
    ap_nn_lr_kind_t sched = AP_NN_LR_COSINE;
    enum {
        O_DATA = 256,
        O_LAYERS,
        O_EMBD,
        O_HEADS,
        O_CTX,
        O_BATCH,
        O_STEPS,
        O_OPTIM,
        O_LR,
        O_SCHED,
        O_WARMUP,
        O_CLIP,
        O_DROPOUT,
        O_SHARE,
        O_SEED,
        O_SAVE,
        O_SAVE_EVERY,
        O_RESUME,
        O_SAMPLE,
        O_LOG,
        O_FUZZ
    };
    static const struct option opts[] = {{"data", required_argument, 0, O_DATA},
                                         {"layers", required_argument, 0, O_LAYERS},
                                         {"embd", required_argument, 0, O_EMBD},
                                         {"heads", required_argument, 0, O_HEADS},
                                         {"ctx", required_argument, 0, O_CTX},
                                         {"batch", required_argument, 0, O_BATCH},
                                         {"steps", required_argument, 0, O_STEPS},
                                         {"optim", required_argument, 0, O_OPTIM},
                                         {"lr", required_argument, 0, O_LR},
                                         {"schedule", required_argument, 0, O_SCHED},
                                         {"warmup", required_argument, 0, O_WARMUP},
                                         {"clip", required_argument, 0, O_CLIP},
                                         {"dropout", required_argument, 0, O_DROPOUT},
                                         {"share-layers", no_argument, 0, O_SHARE},
                                         {"seed", required_argument, 0, O_SEED},
                                         {"save", required_argument, 0, O_SAVE},
                                         {"save-every", required_argument, 0, O_SAVE_EVERY},
                                         {"resume", required_argument, 0, O_RESUME},
                                         {"sample", required_argument, 0, O_SAMPLE},
                                         {"log-level", required_argument, 0, O_LOG},
                                         {"fuzz-corpus", required_argument, 0, O_FUZZ},
                                         {"help", no_argument, 0, 'h'},
                                         {0, 0, 0, 0}};
    optind = 1;
    int c;
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        switch (c) {
        case O_DATA:
            data = optarg;
            break;
        case O_LAYERS: {
            long long v_;
            if (!ap_cli_int("--layers", optarg, 0, 1000000000, &v_)) return 2;
            layers = (int)v_;
        } break;
        case O_EMBD: {
            long long v_;
            if (!ap_cli_int("--embd", optarg, 0, 1000000000, &v_)) return 2;
            embd = (int)v_;
        } break;
        case O_HEADS: {
            long long v_;
            if (!ap_cli_int("--heads", optarg, 0, 1000000000, &v_)) return 2;
            heads = (int)v_;
        } break;
        case O_CTX: {
            long long v_;
            if (!ap_cli_int("--ctx", optarg, 0, 1000000000, &v_)) return 2;
            ctx = (int)v_;
        } break;
        case O_BATCH: {
            long long v_;
            if (!ap_cli_int("--batch", optarg, 0, 1000000000, &v_)) return 2;
            batch = (int)v_;
        } break;
        case O_STEPS: {
            long long v_;
            if (!ap_cli_int("--steps", optarg, 0, 1000000000, &v_)) return 2;
            steps = (int)v_;
        } break;
        case O_OPTIM:
            if (ap_nn_solver_kind_from_name(optarg, &okind)) {
                fprintf(stderr, "apiary nn-train: unknown optimizer '%s' (adamw|adam|sgd|lamb)\n",
                        optarg);
                return 2;
            }
            break;
        case O_LR: {
            double v_;
            if (!ap_cli_num("--lr", optarg, 0, 1e6, &v_)) return 2;
            lr = (float)v_;
        } break;
        case O_SCHED:
            if (ap_nn_lr_kind_from_name(optarg, &sched)) {
                fprintf(stderr,
                        "apiary nn-train: unknown schedule '%s' (cosine|linear|constant|rsqrt)\n",
                        optarg);
                return 2;
            }
            break;
        case O_WARMUP: {
            long long v_;
            if (!ap_cli_int("--warmup", optarg, 0, 1000000000, &v_)) return 2;
            warmup = (int)v_;
        } break;
        case O_CLIP: {
            double v_;
            if (!ap_cli_num("--clip", optarg, 0, 1e30, &v_)) return 2;
            clip = (float)v_;
        } break;
        case O_DROPOUT: {
            double v_;
            if (!ap_cli_num("--dropout", optarg, 0, 0.99, &v_)) return 2;
            dropout = (float)v_;
        } break;
        case O_SHARE:
            share = true;
            break;
        case O_SEED: {
            long long v_;
            if (!ap_cli_int("--seed", optarg, 0, 0x7fffffffffffffffLL, &v_)) return 2;
            seed = (uint64_t)v_;
        } break;
        case O_SAVE:
            save = optarg;
            break;
        case O_SAVE_EVERY: {
            long long v_;
            if (!ap_cli_int("--save-every", optarg, 0, 1000000000, &v_)) return 2;
            save_every = (int)v_;
        } break;
        case O_RESUME:
            resume = optarg;
            break;
        case O_SAMPLE: {
            long long v_;
            if (!ap_cli_int("--sample", optarg, 0, 1000000000, &v_)) return 2;
            sample = (int)v_;
        } break;
        case O_LOG:
            if (!ap_cli_set_log_level(optarg)) return 2;
            break;
        case O_FUZZ:
            return write_fuzz_corpus(optarg);
        case 'h':
            usage(stdout);
            return 0;
        default:
            usage(stderr);
            return 2;
        }
    }
    if (optind < argc || steps < 0 || sample < 0 || warmup < 0 || !(lr > 0) || !(clip >= 0)) {
        fprintf(stderr, "apiary nn-train: bad arguments (see --help)\n");
        return 2;
    }
    if (!data) data = ap_nn_default_corpus();
    ap_nn_text_t *text;
    int rc = ap_nn_text_open(data, &text);
    if (rc) {
        fprintf(stderr, "apiary nn-train: cannot use %s as training data: %s\n", data,
                ap_strerror(rc));
        return 1;
    }
    ap_nn_gpt_config_t cfg = ap_nn_gpt_config_default(ctx, layers, heads, embd, batch);
    cfg.share_layers = share;
    cfg.dropout = dropout;
    ap_nn_model_t *m = NULL;
    ap_nn_solver_t *o = NULL;
    int32_t *tok = NULL, *tg = NULL;
    if ((rc = ap_nn_gpt_new(&cfg, &m))) {
        fprintf(stderr, "apiary nn-train: bad model configuration: %s (see the log line above)\n",
                ap_strerror(rc));
        goto out;
    }
    ap_nn_model_init(m, seed);
    ap_nn_model_set_train(m, true, seed);
    ap_nn_params_t *p = ap_nn_model_params(m);
    ap_nn_solver_config_t oc = ap_nn_solver_defaults(okind);
    if ((rc = ap_nn_solver_new(&oc, p->count, p->views, p->nviews, &o))) goto out;
    uint64_t step = 0;
    if (resume && (rc = ap_nn_checkpoint_load(resume, m, o, &step))) {
        fprintf(stderr, "apiary nn-train: cannot resume from %s: %s\n", resume, ap_strerror(rc));
        goto out;
    }
    tok = malloc(sizeof(int32_t) * (size_t)batch * ctx);
    tg = malloc(sizeof(int32_t) * (size_t)batch * ctx);
    if (!tok || !tg) {
        rc = AP_ENOMEM;
        goto out;
    }
    ap_nn_lr_schedule_t ls = {.kind = sched,
                              .base = lr,
                              .min = lr * 0.1f,
                              .warmup = (uint64_t)warmup,
                              /* rsqrt decays from the warm-up's end */
                              .total = sched == AP_NN_LR_RSQRT ? 0 : (uint64_t)steps};
    fprintf(stderr, "nn-train: %zu parameters, %zu bytes of text, %zu windows of %d\n", p->count,
            ap_nn_text_size(text), ap_nn_text_windows(text, ctx), ctx);
    uint64_t cursor = step * (uint64_t)batch, skipped = 0;
    double t0 = now_s(), ema = 0;
    uint64_t done = 0;
    for (; step < (uint64_t)steps; step++) {
        if ((rc = ap_nn_text_batch(text, seed, &cursor, batch, ctx, tok, tg))) goto out;
        ap_nn_model_zero_grad(m);
        float loss;
        rc = ap_nn_gpt_loss(m, tok, tg, batch, ctx, &loss);
        if (rc == AP_ENONFINITE) {
            skipped++;
            fprintf(stderr, "\nnn-train: step %llu skipped: non-finite loss\n",
                    (unsigned long long)step);
            continue;
        }
        if (rc || (rc = ap_nn_gpt_backward(m, NULL, NULL))) goto out;
        double norm = ap_nn_clip_grad_norm(p->grad, p->count, clip);
        if (!isfinite(norm)) {
            skipped++;
            fprintf(stderr, "\nnn-train: step %llu skipped: non-finite gradient norm\n",
                    (unsigned long long)step);
            continue;
        }
        if ((rc = ap_nn_solver_step(o, p->data, p->grad, ap_nn_lr_at(&ls, step)))) goto out;
        ema = ema == 0 ? loss : 0.95 * ema + 0.05 * loss;
        done++;
        double el = now_s() - t0;
        fprintf(stderr, "\rstep %llu/%d  loss %.4f (avg %.4f)  %.0f tok/s  lr %.2e  |g| %.2f   ",
                (unsigned long long)step + 1, steps, loss, ema,
                el > 0 ? (double)done * batch * ctx / el : 0.0, (double)ap_nn_lr_at(&ls, step),
                norm);
        if (save && save_every > 0 && (step + 1) % (uint64_t)save_every == 0 &&
            (rc = ap_nn_checkpoint_save(save, m, o, step + 1)))
            goto out;
    }
    fprintf(stderr, "\n");
    if (skipped) fprintf(stderr, "nn-train: %llu steps skipped\n", (unsigned long long)skipped);
    if (save && (rc = ap_nn_checkpoint_save(save, m, o, step))) {
        fprintf(stderr, "apiary nn-train: cannot save %s: %s\n", save, ap_strerror(rc));
        goto out;
    }
    if (sample > 0) {
        uint8_t *outb = malloc((size_t)sample);
        const uint8_t *prompt = ap_nn_text_bytes(text);
        if (outb && !(rc = ap_nn_gpt_generate(m, prompt, 1, outb, sample, 0.8f, seed))) {
            printf("%c", prompt[0]);
            fwrite(outb, 1, (size_t)sample, stdout);
            printf("\n");
        }
        free(outb);
    }
out:
    if (rc) fprintf(stderr, "apiary nn-train: %s\n", ap_strerror(rc));
    free(tok);
    free(tg);
    ap_nn_solver_free(o);
    ap_nn_model_free(m);
    ap_nn_text_free(text);
    return rc ? 1 : 0;
}

AP_CLI_COMMAND(nn_train_cmd, "nn-train", nn_train_main,
               "train the model kit's GPT on a text file in this process (debugging)")
