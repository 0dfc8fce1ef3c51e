/* The C API, compiled as C: AdamW steps on the host device (DRAM and NVMe)
 * against a scalar reference in double precision, per-group hyperparameters
 * and set_lr, stats and plan text, checkpoint save/load, the failed-step state,
 * rebinding a param's memory, reloading written params, shapes and the export, the step trace, and
 * the error paths (status codes and strata_last_error). Exit status 0 on success; each failure
 * prints a line. */
#include "offload/strata_c.h"

#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int failures = 0;

#define EXPECT(cond)                                                                \
  do {                                                                              \
    if (!(cond)) {                                                                  \
      fprintf(stderr, "%s:%d: EXPECT(%s) failed; last error: %s\n", __FILE__, __LINE__, \
              #cond, strata_last_error());                                          \
      ++failures;                                                                   \
    }                                                                               \
  } while (0)

#define CHECK_OK(expr)                                                                         \
  do {                                                                                         \
    int st_ = (expr);                                                                          \
    if (st_ != STRATA_OK) {                                                                    \
      fprintf(stderr, "%s:%d: %s returned %s: %s\n", __FILE__, __LINE__, #expr,                \
              strata_status_name(st_), strata_last_error());                                   \
      exit(1);                                                                                 \
    }                                                                                          \
  } while (0)

enum { kW = 1000, kB = 37, kSteps = 5 };

/* torch.optim.AdamW on one tensor, in double. */
typedef struct {
  double p[kW], m[kW], v[kW];
} Ref;

static void RefStep(Ref* r, const float* g, int n, strata_hyper h, int step) {
  const double bc1 = 1.0 - pow(h.beta1, step), bc2 = 1.0 - pow(h.beta2, step);
  for (int i = 0; i < n; ++i) {
    r->p[i] *= 1.0 - h.lr * h.weight_decay;
    r->m[i] = h.beta1 * r->m[i] + (1 - h.beta1) * g[i];
    r->v[i] = h.beta2 * r->v[i] + (1 - h.beta2) * (double)g[i] * g[i];
    r->p[i] -= h.lr * (r->m[i] / bc1) / (sqrt(r->v[i] / bc2) + h.eps);
  }
}

static float Rand(unsigned* s) {
  *s = *s * 1664525u + 1013904223u;
  return ((float)(*s >> 8) / (float)(1u << 24)) * 2.0f - 1.0f;
}

/* Trains two tensors in two groups; `config` selects DRAM or NVMe. */
static void TrainAndCompare(strata_device* dev, const char* config) {
  static float w[kW], gw[kW], b[kB], gb[kB];
  static Ref rw, rb;
  unsigned seed = 12345;
  for (int i = 0; i < kW; ++i) rw.p[i] = w[i] = Rand(&seed), rw.m[i] = rw.v[i] = 0;
  for (int i = 0; i < kB; ++i) rb.p[i] = b[i] = Rand(&seed), rb.m[i] = rb.v[i] = 0;
  strata_param params[2] = {{"w", w, gw, kW, 0}, {NULL, b, gb, kB, 1}};
  strata_hyper hypers[2] = {{1e-2, 0.9, 0.999, 1e-8, 0.1}, {3e-2, 0.8, 0.99, 1e-6, 0.0}};
  strata_optimizer* opt = NULL;
  CHECK_OK(strata_optimizer_create(dev, NULL, NULL, config, params, 2, hypers, 2, &opt));
  EXPECT(strata_optimizer_num_groups(opt) == 2);
  EXPECT(strata_optimizer_world_size(opt) == 1);
  EXPECT(strata_optimizer_loss_scale(opt) == 1.0);

  size_t plan_len = strata_optimizer_format_plan(opt, NULL, 0);
  EXPECT(plan_len > 0);
  char* plan = malloc(plan_len + 1);
  EXPECT(strata_optimizer_format_plan(opt, plan, plan_len + 1) == plan_len);
  EXPECT(strlen(plan) == plan_len);
  free(plan);

  for (int step = 1; step <= kSteps; ++step) {
    if (step == 3) {
      hypers[0].lr = 5e-3;
      CHECK_OK(strata_optimizer_set_lr(opt, 0, 5e-3));
      strata_hyper got;
      CHECK_OK(strata_optimizer_get_hyper(opt, 0, &got));
      EXPECT(got.lr == 5e-3 && got.weight_decay == 0.1);
      /* Weights written after create (loaded late): the next steps start
       * from them once reloaded, as the reference's do. */
      for (int i = 0; i < 10; ++i) rw.p[i] = w[i] = 0.5f;
      uint64_t adopted = 0;
      CHECK_OK(strata_optimizer_reload_params(opt, NULL, 0, &adopted));
      EXPECT(adopted == 10);
      const uint32_t bias = 1;
      CHECK_OK(strata_optimizer_reload_params(opt, &bias, 1, NULL));
    }
    for (int i = 0; i < kW; ++i) gw[i] = Rand(&seed);
    for (int i = 0; i < kB; ++i) gb[i] = Rand(&seed);
    CHECK_OK(strata_optimizer_step(opt));
    RefStep(&rw, gw, kW, hypers[0], step);
    RefStep(&rb, gb, kB, hypers[1], step);
    CHECK_OK(strata_optimizer_zero_grad(opt));
    EXPECT(gw[0] == 0.0f && gw[kW - 1] == 0.0f && gb[kB - 1] == 0.0f);
  }
  /* fp32 CPU Adam vs a double reference: a few ulps of the update each step. */
  double worst = 0;
  for (int i = 0; i < kW; ++i) worst = fmax(worst, fabs(w[i] - rw.p[i]));
  for (int i = 0; i < kB; ++i) worst = fmax(worst, fabs(b[i] - rb.p[i]));
  if (worst > 1e-5) fprintf(stderr, "max |param - reference| = %g\n", worst);
  EXPECT(worst <= 1e-5);

  strata_step_stats stats;
  CHECK_OK(strata_optimizer_last_step(opt, &stats, sizeof stats));
  EXPECT(stats.step == kSteps && strata_optimizer_step_count(opt) == kSteps);
  EXPECT(stats.skipped == 0 && stats.grad_norm > 0 && stats.step_sec > 0);
  char line[8];
  size_t n = strata_optimizer_format_stats(opt, line, sizeof line);
  EXPECT(n > sizeof line && strlen(line) == sizeof line - 1); /* truncated, NUL-terminated */
  strata_optimizer_free(opt);
}

/* Save, train on, then load into a fresh optimizer over other param values:
 * the load restores params, state, counters and hyperparameters, and the
 * same grads then give bitwise the same params. */
static void SaveLoad(strata_device* dev, const char* dir) {
  enum { kN = 700 };
  static float a[kN], ga[kN], b[kN], gb[kN], after_a[kN];
  unsigned seed = 99;
  for (int i = 0; i < kN; ++i) a[i] = Rand(&seed), b[i] = 5.0f;
  strata_param pa = {"w", a, ga, kN, 0}, pb = {"w", b, gb, kN, 0};
  const char* config = "{\"gradient_clipping\": 1.0}";
  strata_optimizer *opt_a = NULL, *opt_b = NULL;
  CHECK_OK(strata_optimizer_create(dev, NULL, NULL, config, &pa, 1, NULL, 1, &opt_a));
  for (int step = 0; step < 3; ++step) {
    for (int i = 0; i < kN; ++i) ga[i] = Rand(&seed);
    CHECK_OK(strata_optimizer_step(opt_a));
  }
  CHECK_OK(strata_optimizer_set_lr(opt_a, 0, 2e-2));
  CHECK_OK(strata_optimizer_save(opt_a, dir));
  unsigned replay = seed;
  for (int step = 0; step < 2; ++step) {
    for (int i = 0; i < kN; ++i) ga[i] = Rand(&seed);
    CHECK_OK(strata_optimizer_step(opt_a));
  }
  memcpy(after_a, a, sizeof a);

  CHECK_OK(strata_optimizer_create(dev, NULL, NULL, config, &pb, 1, NULL, 1, &opt_b));
  CHECK_OK(strata_optimizer_load(opt_b, dir));
  EXPECT(strata_optimizer_step_count(opt_b) == 3);
  strata_hyper h;
  CHECK_OK(strata_optimizer_get_hyper(opt_b, 0, &h));
  EXPECT(h.lr == 2e-2);
  for (int step = 0; step < 2; ++step) {
    for (int i = 0; i < kN; ++i) gb[i] = Rand(&replay);
    CHECK_OK(strata_optimizer_step(opt_b));
  }
  EXPECT(memcmp(after_a, b, sizeof b) == 0);
  EXPECT(strata_optimizer_load(opt_b, "/nonexistent/strata_ckpt") != STRATA_OK);
  EXPECT(strlen(strata_last_error()) > 0);
  strata_optimizer_free(opt_a);
  strata_optimizer_free(opt_b);
}

/* Flips (and later restores) the headers of both slots of the last extent of
 * an NVMe state file: the next step fails on its last sub-group. */
typedef struct {
  char path[700];
  long offsets[2];
  unsigned char saved[2][64];
} Corruption;

static long JsonInt(const char* text, const char* key) {
  const char* at = strstr(text, key);
  return at == NULL ? -1 : atol(at + strlen(key));
}

static void FlipSlots(Corruption* c, int restore) {
  FILE* f = fopen(c->path, "r+b");
  if (f == NULL) {
    perror(c->path);
    exit(1);
  }
  if (!restore) {
    char sb[4097] = {0};
    EXPECT(fread(sb, 1, 4096, f) == 4096);
    const long extent = JsonInt(sb, "\"extent_bytes\":"), n = JsonInt(sb, "\"num_extents\":");
    const long block = JsonInt(sb, "\"block_bytes\":");
    /* The superblock and every slot take whole blocks. */
    const long slot = (4096 + (extent + 4095) / 4096 * 4096 + block - 1) / block * block;
    c->offsets[0] = block + (2 * n - 2) * slot;
    c->offsets[1] = c->offsets[0] + slot;
  }
  for (int k = 0; k < 2; ++k) {
    unsigned char buf[64];
    fseek(f, c->offsets[k], SEEK_SET);
    if (!restore) {
      EXPECT(fread(c->saved[k], 1, 64, f) == 64);
      for (int i = 0; i < 64; ++i) buf[i] = c->saved[k][i] ^ 0xFF;
    } else {
      memcpy(buf, c->saved[k], 64);
    }
    fseek(f, c->offsets[k], SEEK_SET);
    EXPECT(fwrite(buf, 1, 64, f) == 64);
  }
  fclose(f);
}

/* The step state machine, rebinding a param's memory, shapes in checkpoints
 * and the export, through the C API. */
static void Safety(strata_device* dev, const char* dir) {
  enum { kN = 700 };
  unsigned seed = 7;
  float* a = malloc(kN * sizeof(float));
  float* ga = calloc(kN, sizeof(float));
  float b[kN], gb[kN];
  for (int i = 0; i < kN; ++i) a[i] = b[i] = Rand(&seed), gb[i] = 0;
  char nvme_a[600], nvme_b[600], config_a[900], config_b[900];
  snprintf(nvme_a, sizeof nvme_a, "%s/nvme_a", dir);
  snprintf(nvme_b, sizeof nvme_b, "%s/nvme_b", dir);
  const char* fmt =
      "{\"gradient_clipping\": 0, \"zero_optimization\": {\"sub_group_size\": 128, "
      "\"offload_optimizer\": {\"device\": \"nvme\", \"nvme_path\": \"%s\"}}}";
  snprintf(config_a, sizeof config_a, fmt, nvme_a);
  snprintf(config_b, sizeof config_b, fmt, nvme_b);
  char cmd[1400];
  snprintf(cmd, sizeof cmd, "mkdir -p '%s' '%s'", nvme_a, nvme_b);
  EXPECT(system(cmd) == 0);
  strata_param pa = {"w", a, ga, kN, 0}, pb = {"w", b, gb, kN, 0};
  strata_optimizer *opt_a = NULL, *opt_b = NULL;
  CHECK_OK(strata_optimizer_create(dev, NULL, NULL, config_a, &pa, 1, NULL, 1, &opt_a));
  CHECK_OK(strata_optimizer_create(dev, NULL, NULL, config_b, &pb, 1, NULL, 1, &opt_b));
  EXPECT(strata_optimizer_step_state(opt_a) == STRATA_STEP_READY);
  EXPECT(strata_optimizer_format_step_failure(opt_a, NULL, 0) == 0);
  EXPECT(strata_optimizer_retry_step(opt_a) == STRATA_FAILED_PRECONDITION);

  /* The trainer moves `w` (new memory, old freed): rebind, and the run goes on
   * bitwise like the twin that never moved. */
  for (int step = 0; step < 2; ++step) {
    for (int i = 0; i < kN; ++i) ga[i] = gb[i] = Rand(&seed);
    CHECK_OK(strata_optimizer_step(opt_a));
    CHECK_OK(strata_optimizer_step(opt_b));
  }
  float* moved = malloc(kN * sizeof(float));
  float* moved_g = calloc(kN, sizeof(float));
  memcpy(moved, a, kN * sizeof(float));
  EXPECT(strata_optimizer_rebind_param(opt_a, 0, NULL, moved_g) == STRATA_INVALID_ARGUMENT);
  EXPECT(strata_optimizer_rebind_param(opt_a, 3, moved, moved_g) == STRATA_OUT_OF_RANGE);
  const uint32_t past = 3;
  EXPECT(strata_optimizer_reload_params(opt_a, &past, 1, NULL) == STRATA_OUT_OF_RANGE);
  EXPECT(strstr(strata_last_error(), "param 3 of") != NULL);
  EXPECT(strata_optimizer_reload_params(opt_a, NULL, 1, NULL) == STRATA_INVALID_ARGUMENT);
  /* A grad that starts inside the data (not the same pointer) is refused. */
  EXPECT(strata_optimizer_rebind_param(opt_a, 0, moved, moved + 1) == STRATA_INVALID_ARGUMENT);
  EXPECT(strstr(strata_last_error(), "overlaps the data of param 0 (w)") != NULL);
  strata_binding twice[2] = {{0, moved, moved_g}, {0, moved, moved_g}};
  EXPECT(strata_optimizer_rebind_params(opt_a, twice, 2) == STRATA_INVALID_ARGUMENT);
  EXPECT(strstr(strata_last_error(), "named twice") != NULL);
  EXPECT(strata_optimizer_rebind_params(opt_a, NULL, 1) == STRATA_INVALID_ARGUMENT);
  CHECK_OK(strata_optimizer_rebind_params(opt_a, twice, 1));
  free(a);
  free(ga);
  a = moved;
  ga = moved_g;
  for (int i = 0; i < kN; ++i) ga[i] = gb[i] = Rand(&seed);
  CHECK_OK(strata_optimizer_step(opt_a));
  CHECK_OK(strata_optimizer_step(opt_b));
  EXPECT(memcmp(a, b, sizeof b) == 0);

  /* A step that fails part way: refused until retried; the retry is the clean step. */
  Corruption c;
  snprintf(c.path, sizeof c.path, "%s/strata-rank0.state", nvme_a);
  FlipSlots(&c, 0);
  for (int i = 0; i < kN; ++i) ga[i] = gb[i] = Rand(&seed);
  EXPECT(strata_optimizer_step(opt_a) != STRATA_OK);
  EXPECT(strata_optimizer_step_state(opt_a) == STRATA_STEP_FAILED);
  char failure[512];
  EXPECT(strata_optimizer_format_step_failure(opt_a, failure, sizeof failure) > 0);
  EXPECT(strstr(failure, "strata-rank0.state") != NULL);
  EXPECT(strata_optimizer_step(opt_a) == STRATA_FAILED_PRECONDITION);
  EXPECT(strstr(strata_last_error(), "RetryStep()") != NULL);
  char never[700];
  snprintf(never, sizeof never, "%s/never", dir);
  EXPECT(strata_optimizer_save(opt_a, never) == STRATA_FAILED_PRECONDITION);
  EXPECT(access(never, F_OK) != 0);
  FlipSlots(&c, 1);
  CHECK_OK(strata_optimizer_retry_step(opt_a));
  EXPECT(strata_optimizer_step_state(opt_a) == STRATA_STEP_READY);
  CHECK_OK(strata_optimizer_step(opt_b));
  EXPECT(memcmp(a, b, sizeof b) == 0);

  /* Shapes: recorded by the save, checked by the load, in the export. */
  const uint64_t shape[2] = {35, 20}, transposed[2] = {20, 35}, wrong[2] = {7, 7};
  EXPECT(strata_optimizer_set_param_shape(opt_a, 0, wrong, 2) == STRATA_INVALID_ARGUMENT);
  EXPECT(strstr(strata_last_error(), "[7, 7]") != NULL);
  /* A product that wraps past 2^64 to the elems (it was taken, and every save
     after it wrote a manifest the reader refuses). */
  const uint64_t wraps[2] = {(UINT64_C(1) << 62) + 175, 4};
  EXPECT(strata_optimizer_set_param_shape(opt_a, 0, wraps, 2) == STRATA_INVALID_ARGUMENT);
  EXPECT(strstr(strata_last_error(), "more than 2^64 elements") != NULL);
  EXPECT(strata_optimizer_set_param_shape(opt_a, 1, shape, 2) == STRATA_OUT_OF_RANGE);
  CHECK_OK(strata_optimizer_set_param_shape(opt_a, 0, shape, 2));
  char ckpt[700], out[800];
  snprintf(ckpt, sizeof ckpt, "%s/shaped", dir);
  snprintf(out, sizeof out, "%s/w.safetensors", dir);
  CHECK_OK(strata_optimizer_save(opt_a, ckpt));
  CHECK_OK(strata_optimizer_set_param_shape(opt_b, 0, transposed, 2));
  EXPECT(strata_optimizer_load(opt_b, ckpt) == STRATA_FAILED_PRECONDITION);
  EXPECT(strstr(strata_last_error(), "shape [35, 20] in the checkpoint, [20, 35] here") != NULL);
  CHECK_OK(strata_checkpoint_export(ckpt, out, "bf16", 0, 0));
  EXPECT(strata_checkpoint_export(ckpt, out, "bf16", 0, 0) == STRATA_FAILED_PRECONDITION);
  CHECK_OK(strata_checkpoint_export(ckpt, out, "fp32", 0, 1));
  EXPECT(strata_checkpoint_export(ckpt, out, "fp64", 0, 1) == STRATA_INVALID_ARGUMENT);
  FILE* f = fopen(out, "rb");
  char header[512] = {0};
  EXPECT(f != NULL && fread(header, 1, sizeof header - 1, f) > 8);
  if (f != NULL) fclose(f);
  EXPECT(strstr(header + 8, "\"shape\":[35,20]") != NULL);
  /* A resumed run that sets no shapes keeps the loaded save's: its next save
     exports shaped (it exported [700]). */
  strata_optimizer_free(opt_b);
  CHECK_OK(strata_optimizer_create(dev, NULL, NULL, config_b, &pb, 1, NULL, 1, &opt_b));
  CHECK_OK(strata_optimizer_load(opt_b, ckpt));
  char resumed[700];
  snprintf(resumed, sizeof resumed, "%s/resumed", dir);
  CHECK_OK(strata_optimizer_save(opt_b, resumed));
  CHECK_OK(strata_checkpoint_export(resumed, out, "fp32", 0, 1));
  memset(header, 0, sizeof header);
  f = fopen(out, "rb");
  EXPECT(f != NULL && fread(header, 1, sizeof header - 1, f) > 8);
  if (f != NULL) fclose(f);
  EXPECT(strstr(header + 8, "\"shape\":[35,20]") != NULL);
  /* and still checks them against a later load */
  EXPECT(strata_optimizer_set_param_shape(opt_b, 0, transposed, 2) == STRATA_OK);
  EXPECT(strata_optimizer_load(opt_b, ckpt) == STRATA_FAILED_PRECONDITION);
  strata_optimizer_free(opt_a);
  strata_optimizer_free(opt_b);
  free(a);
  free(ga);
}

static char* ReadAll(const char* path) {
  FILE* f = fopen(path, "rb");
  if (f == NULL) return NULL;
  fseek(f, 0, SEEK_END);
  const long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  char* text = malloc((size_t)n + 1);
  if (text != NULL) {
    text[fread(text, 1, (size_t)n, f)] = '\0';
  }
  fclose(f);
  return text;
}

/* A slice of step `step` ("step":N followed by , or } in its args). */
static int HasStep(const char* text, int step) {
  char a[32], b[32];
  snprintf(a, sizeof a, "\"step\":%d,", step);
  snprintf(b, sizeof b, "\"step\":%d}", step);
  return strstr(text, a) != NULL || strstr(text, b) != NULL;
}

/* Records steps 3-5 of 7 and writes them; errors for bad arguments and paths. */
static void Trace(strata_device* dev, const char* dir) {
  enum { kN = 1000 };
  static float w[kN], g[kN];
  unsigned seed = 5;
  for (int i = 0; i < kN; ++i) w[i] = Rand(&seed);
  strata_param p = {"w", w, g, kN, 0};
  strata_optimizer* opt = NULL;
  CHECK_OK(strata_optimizer_create(dev, NULL, NULL, "{\"zero_optimization\": {\"sub_group_size\": 256}}",
                                   &p, 1, NULL, 1, &opt));
  for (int step = 1; step <= 7; ++step) {
    if (step == 3) CHECK_OK(strata_optimizer_trace_enable(opt, 8));
    if (step == 6) CHECK_OK(strata_optimizer_trace_enable(opt, 0));
    for (int i = 0; i < kN; ++i) g[i] = Rand(&seed);
    CHECK_OK(strata_optimizer_step(opt));
  }
  char path[700];
  snprintf(path, sizeof path, "%s/trace.json", dir);
  CHECK_OK(strata_optimizer_trace_write(opt, path, "{\"run\": \"c test\", \"rank\": 0}"));
  char* text = ReadAll(path);
  EXPECT(text != NULL);
  if (text != NULL) {
    EXPECT(strstr(text, "\"traceEvents\"") != NULL);
    EXPECT(strstr(text, "\"cat\":\"pcie d2h\"") != NULL);
    EXPECT(strstr(text, "\"cat\":\"cpu adam\"") != NULL);
    EXPECT(strstr(text, "\"cat\":\"pcie h2d\"") != NULL);
    EXPECT(strstr(text, "\"name\":\"adam 3\"") != NULL); /* sub-group 3 of 4 */
    EXPECT(HasStep(text, 3) && HasStep(text, 4) && HasStep(text, 5));
    EXPECT(!HasStep(text, 1) && !HasStep(text, 2) && !HasStep(text, 6) && !HasStep(text, 7));
    EXPECT(strstr(text, "\"run\":\"c test\"") != NULL);
    EXPECT(strstr(text, "\"params\":1000") != NULL);
    EXPECT(strstr(text, "\"world_size\":1") != NULL);
    EXPECT(strstr(text, "\"step_count\":7") != NULL);
    free(text);
  }

  EXPECT(strata_optimizer_trace_enable(opt, -1) == STRATA_INVALID_ARGUMENT);
  EXPECT(strstr(strata_last_error(), "steps is -1") != NULL);
  EXPECT(strata_optimizer_trace_enable(opt, INT_MAX) == STRATA_INVALID_ARGUMENT);
  EXPECT(strstr(strata_last_error(), "at most 1000 steps") != NULL);
  EXPECT(strata_optimizer_trace_enable(NULL, 1) == STRATA_INVALID_ARGUMENT);
  EXPECT(strata_optimizer_trace_write(opt, NULL, NULL) == STRATA_INVALID_ARGUMENT);
  EXPECT(strata_optimizer_trace_write(opt, path, "[1]") == STRATA_INVALID_ARGUMENT);
  EXPECT(strstr(strata_last_error(), "other_data_json is a JSON array, not an object") != NULL);
  EXPECT(strata_optimizer_trace_write(opt, path, "{\"run\": ") == STRATA_INVALID_ARGUMENT);
  EXPECT(strstr(strata_last_error(), "other_data_json is not valid JSON") != NULL);
  EXPECT(strata_optimizer_trace_write(opt, path, "{\"big\": 1e400}") == STRATA_INVALID_ARGUMENT);
  EXPECT(strata_optimizer_trace_write(opt, path, "{\"run\": 1, \"run\": 2}") ==
         STRATA_INVALID_ARGUMENT);
  EXPECT(strstr(strata_last_error(), "other_data_json has the key run more than once") != NULL);
  char missing[720];
  snprintf(missing, sizeof missing, "%s/no/such/trace.json", dir);
  EXPECT(strata_optimizer_trace_write(opt, missing, NULL) != STRATA_OK);
  EXPECT(strstr(strata_last_error(), missing) != NULL);
  /* Recording on, then a write: it keeps recording. */
  CHECK_OK(strata_optimizer_trace_enable(opt, 1));
  CHECK_OK(strata_optimizer_trace_write(opt, path, NULL));
  CHECK_OK(strata_optimizer_step(opt));
  CHECK_OK(strata_optimizer_trace_write(opt, path, NULL));
  text = ReadAll(path);
  EXPECT(text != NULL && HasStep(text, 8) && !HasStep(text, 5));
  free(text);
  strata_optimizer_free(opt);
}

/* Two threads on one optimizer: a call while another thread's call runs is
 * refused with STRATA_FAILED_PRECONDITION naming the running call, never run
 * beside it. One thread steps, the other sets the lr, until a refusal. */
typedef struct {
  strata_optimizer* opt;
  atomic_int stop;
  atomic_int refused;
  int failures;
} Race;

static void* StepUntilStopped(void* arg) {
  Race* r = arg;
  for (int i = 0; i < 5000 && !atomic_load(&r->stop) && atomic_load(&r->refused) == 0; ++i) {
    const int st = strata_optimizer_step(r->opt);
    if (st == STRATA_FAILED_PRECONDITION &&
        strstr(strata_last_error(), "is running on this optimizer in another thread") != NULL) {
      atomic_fetch_add(&r->refused, 1);
    } else if (st != STRATA_OK) {
      ++r->failures;
    }
  }
  return NULL;
}

/* One fp32 tensor of n zeros, its grad, and an optimizer of the default config. */
typedef struct {
  float* w;
  float* g;
  strata_optimizer* opt;
} OneTensor;

static OneTensor MakeOneTensor(strata_device* dev, size_t n) {
  OneTensor t = {calloc(n, sizeof(float)), calloc(n, sizeof(float)), NULL};
  strata_param p = {"w", t.w, t.g, n, 0};
  CHECK_OK(strata_optimizer_create(dev, NULL, NULL, "{}", &p, 1, NULL, 1, &t.opt));
  return t;
}

static void FreeOneTensor(OneTensor* t) {
  strata_optimizer_free(t->opt);
  free(t->w);
  free(t->g);
}

static void TwoThreads(strata_device* dev) {
  OneTensor t = MakeOneTensor(dev, 1 << 18);
  Race race = {.opt = t.opt, .failures = 0};
  atomic_init(&race.stop, 0);
  atomic_init(&race.refused, 0);
  pthread_t stepper;
  EXPECT(pthread_create(&stepper, NULL, StepUntilStopped, &race) == 0);
  int refused_here = 0, ok_here = 0;
  for (long i = 0; i < 50000000 && atomic_load(&race.refused) + refused_here == 0; ++i) {
    const int st = strata_optimizer_set_lr(race.opt, 0, 1e-3);
    if (st == STRATA_OK) {
      ++ok_here;
    } else {
      EXPECT(st == STRATA_FAILED_PRECONDITION);
      EXPECT(strstr(strata_last_error(), "strata_optimizer_step is running on this optimizer") !=
             NULL);
      ++refused_here;
    }
  }
  atomic_store(&race.stop, 1);
  pthread_join(stepper, NULL);
  EXPECT(refused_here + atomic_load(&race.refused) > 0);
  EXPECT(race.failures == 0);
  /* Afterwards the optimizer takes calls again. */
  CHECK_OK(strata_optimizer_step(race.opt));
  CHECK_OK(strata_optimizer_set_lr(race.opt, 0, 1e-3));
  printf("two threads: %d refused here, %d in the stepping thread, %d set_lr calls ran\n",
         refused_here, atomic_load(&race.refused), ok_here);
  FreeOneTensor(&t);
}

static void Errors(strata_device* dev) {
  float w[4] = {0}, g[4] = {0};
  strata_param p = {"w", w, g, 4, 0};
  strata_optimizer* opt = (strata_optimizer*)1;

  EXPECT(strata_optimizer_create(dev, NULL, NULL, "{\"zero_optimization\": {\"stag\": 2}}", &p, 1,
                                 NULL, 1, &opt) == STRATA_INVALID_ARGUMENT);
  EXPECT(opt == NULL);
  EXPECT(strstr(strata_last_error(), "zero_optimization.stag") != NULL);
  EXPECT(strstr(strata_last_error(), "did you mean stage") != NULL);

  EXPECT(strata_optimizer_create(dev, NULL, NULL, "{not json", &p, 1, NULL, 1, &opt) ==
         STRATA_INVALID_ARGUMENT);
  EXPECT(strata_optimizer_create(
             dev, NULL, NULL, "{\"zero_optimization\": {\"offload_optimizer\": {\"device\": \"nvme\"}}}",
             &p, 1, NULL, 1, &opt) == STRATA_INVALID_ARGUMENT);
  EXPECT(strstr(strata_last_error(), "nvme_path") != NULL);

  strata_param null_grad = {"w", w, NULL, 4, 0};
  EXPECT(strata_optimizer_create(dev, NULL, NULL, "{}", &null_grad, 1, NULL, 1, &opt) ==
         STRATA_INVALID_ARGUMENT);
  EXPECT(strstr(strata_last_error(), "null grad") != NULL);

  /* Overlapping tensors: the grad starts inside the data. Adjacent is fine. */
  strata_param overlap = {"w", w, w + 2, 2, 0};
  CHECK_OK(strata_optimizer_create(dev, NULL, NULL, "{}", &overlap, 1, NULL, 1, &opt));
  strata_optimizer_free(opt);
  overlap.grad = w + 1;
  EXPECT(strata_optimizer_create(dev, NULL, NULL, "{}", &overlap, 1, NULL, 1, &opt) ==
         STRATA_INVALID_ARGUMENT);
  EXPECT(strstr(strata_last_error(), "the grad of param 0 (w)") != NULL);
  EXPECT(strstr(strata_last_error(), "overlaps the data of param 0 (w)") != NULL);

  /* An fp32 grad that does not start at a multiple of 4 bytes. */
  strata_param misaligned = {"w", w, (char*)g + 2, 1, 0};
  EXPECT(strata_optimizer_create(dev, NULL, NULL, "{}", &misaligned, 1, NULL, 1, &opt) ==
         STRATA_INVALID_ARGUMENT);
  EXPECT(strstr(strata_last_error(), "is not aligned to its 4-byte fp32 elements") != NULL);

  /* More groups than params: refused before anything is sized by num_groups. */
  EXPECT(strata_optimizer_create(dev, NULL, NULL, "{}", &p, 1, NULL, UINT32_MAX, &opt) ==
         STRATA_INVALID_ARGUMENT);
  EXPECT(strstr(strata_last_error(), "every group needs at least one") != NULL);

  /* A key repeated in an object would drop a setting unseen. */
  EXPECT(strata_optimizer_create(dev, NULL, NULL,
                                 "{\"gradient_clipping\": 1, \"gradient_clipping\": 0}", &p, 1,
                                 NULL, 1, &opt) == STRATA_INVALID_ARGUMENT);
  EXPECT(strstr(strata_last_error(), "gradient_clipping appears more than once") != NULL);

  /* A path that is not UTF-8 comes back escaped: the message stays UTF-8. */
  EXPECT(strata_optimizer_create(
             dev, NULL, NULL,
             "{\"zero_optimization\": {\"offload_optimizer\": {\"device\": \"nvme\", "
             "\"nvme_path\": \"/proc/no-\xff-dir\"}}}",
             &p, 1, NULL, 1, &opt) != STRATA_OK);
  EXPECT(strstr(strata_last_error(), "no-\\xff") != NULL);
  EXPECT(strchr(strata_last_error(), '\xff') == NULL);

  strata_param bad_group = {"w", w, g, 4, 3};
  EXPECT(strata_optimizer_create(dev, NULL, NULL, "{}", &bad_group, 1, NULL, 1, &opt) ==
         STRATA_INVALID_ARGUMENT);
  EXPECT(strstr(strata_last_error(), "group 3") != NULL);

  /* The host device has no native streams to order work on. */
  EXPECT(strata_optimizer_create(dev, NULL, (void*)&p, "{}", &p, 1, NULL, 1, &opt) ==
         STRATA_INVALID_ARGUMENT);
  EXPECT(strstr(strata_last_error(), "no native streams") != NULL);

  EXPECT(strata_optimizer_create(NULL, NULL, NULL, "{}", &p, 1, NULL, 1, &opt) ==
         STRATA_INVALID_ARGUMENT);
  EXPECT(strstr(strata_last_error(), "device is NULL") != NULL);
  EXPECT(strata_optimizer_step(NULL) == STRATA_INVALID_ARGUMENT);
  EXPECT(strata_optimizer_reload_params(NULL, NULL, 0, NULL) == STRATA_INVALID_ARGUMENT);

  /* A success clears the last error; a bad hyperparameter is refused. */
  CHECK_OK(strata_optimizer_create(dev, NULL, NULL, "{\"gradient_clipping\": 0}", &p, 1, NULL, 1,
                                   &opt));
  EXPECT(strcmp(strata_last_error(), "") == 0);
  EXPECT(strata_optimizer_set_lr(opt, 0, -1.0) == STRATA_INVALID_ARGUMENT);
  EXPECT(strstr(strata_last_error(), "lr") != NULL);
  EXPECT(strata_optimizer_set_lr(opt, 7, 1e-3) == STRATA_OUT_OF_RANGE);
  strata_hyper h;
  EXPECT(strata_optimizer_get_hyper(opt, 1, &h) == STRATA_OUT_OF_RANGE);
  EXPECT(strata_optimizer_grad_ready(opt, 1) == STRATA_OUT_OF_RANGE);
  /* The same for a path the engine names in its error. */
  EXPECT(strata_optimizer_save(opt, "/proc/no-\xff-dir/ckpt") != STRATA_OK);
  EXPECT(strstr(strata_last_error(), "/proc/no-\\xff-dir") != NULL);
  EXPECT(strchr(strata_last_error(), '\xff') == NULL);
  strata_optimizer_free(opt);

  strata_device* bad = (strata_device*)1;
  EXPECT(strata_device_open("tpu:0", &bad) == STRATA_INVALID_ARGUMENT);
  EXPECT(bad == NULL);
  EXPECT(strcmp(strata_status_name(STRATA_DATA_LOSS), "DataLoss") == 0);
  EXPECT(strcmp(strata_status_name(42), "Unknown") == 0);
  strata_optimizer_free(NULL);
  strata_device_free(NULL);
  strata_comm_free(NULL);
}

/* A monitor thread reads the value getters while the driving thread steps: never
 * refused, the step count and last step it sees only grow, the texts are whole. */
typedef struct {
  strata_optimizer* opt;
  atomic_int stop;
  int backwards, reads;
} Monitor;

static void* Watch(void* arg) {
  Monitor* m = arg;
  int64_t last = 0, last_step = 0;
  char text[512];
  while (!atomic_load(&m->stop)) {
    const int64_t n = strata_optimizer_step_count(m->opt);
    if (n < last) ++m->backwards;
    last = n;
    strata_step_stats stats;
    if (strata_optimizer_last_step(m->opt, &stats, sizeof stats) != STRATA_OK ||
        stats.step < last_step || stats.skipped != 0 ||
        strata_optimizer_last_step_nonfinite(m->opt) != 0) {
      ++m->backwards;
    }
    last_step = stats.step;
    if (strata_optimizer_loss_scale(m->opt) != 1.0) ++m->backwards;
    if (strata_optimizer_step_state(m->opt) != STRATA_STEP_READY) ++m->backwards;
    (void)strata_optimizer_format_stats(m->opt, text, sizeof text);
    if (strata_optimizer_format_step_failure(m->opt, text, sizeof text) != 0) ++m->backwards;
    ++m->reads;
  }
  return NULL;
}

/* What a log callback received: lines, and the first info line. */
typedef struct {
  pthread_mutex_t mu;
  int lines;
  int info_lines;
  char first_info[256];
} LogSeen;

static void CollectLog(void* user, int level, const char* message) {
  LogSeen* seen = (LogSeen*)user;
  pthread_mutex_lock(&seen->mu);
  ++seen->lines;
  if (level == STRATA_LOG_INFO && seen->info_lines++ == 0) {
    snprintf(seen->first_info, sizeof seen->first_info, "%s", message);
  }
  pthread_mutex_unlock(&seen->mu);
}

/* The log level and a callback, from C: lines reach the callback with the
 * user pointer, none below the level does, and NULL puts stderr back. */
static void Logging(strata_device* dev) {
  LogSeen seen;
  memset(&seen, 0, sizeof seen);
  pthread_mutex_init(&seen.mu, NULL);
  const int before = strata_log_level();
  float w[8] = {0}, g[8] = {0};
  strata_param p = {"w", w, g, 8, 0};
  strata_optimizer* opt = NULL;
  CHECK_OK(strata_set_log_level(STRATA_LOG_INFO));
  EXPECT(strata_log_level() == STRATA_LOG_INFO);
  CHECK_OK(strata_set_log_callback(CollectLog, &seen));
  CHECK_OK(strata_optimizer_create(dev, NULL, NULL, "{}", &p, 1, NULL, 1, &opt));
  strata_optimizer_free(opt);
  pthread_mutex_lock(&seen.mu);
  EXPECT(seen.info_lines > 0);
  EXPECT(strstr(seen.first_info, "rank 0/1") != NULL);
  EXPECT(strncmp(seen.first_info, "strata:", 7) != 0); /* the message alone */
  seen.lines = 0;
  pthread_mutex_unlock(&seen.mu);
  CHECK_OK(strata_set_log_level(STRATA_LOG_ERROR));
  CHECK_OK(strata_optimizer_create(dev, NULL, NULL, "{}", &p, 1, NULL, 1, &opt));
  strata_optimizer_free(opt);
  pthread_mutex_lock(&seen.mu);
  EXPECT(seen.lines == 0);
  pthread_mutex_unlock(&seen.mu);
  EXPECT(strata_set_log_level(STRATA_LOG_OFF + 1) == STRATA_INVALID_ARGUMENT);
  EXPECT(strstr(strata_last_error(), "level 5") != NULL);
  EXPECT(strata_set_log_level(-1) == STRATA_INVALID_ARGUMENT);
  EXPECT(strata_log_level() == STRATA_LOG_ERROR);
  CHECK_OK(strata_set_log_callback(NULL, NULL));
  CHECK_OK(strata_set_log_level(before));
  pthread_mutex_destroy(&seen.mu);
}

static void MonitorThread(strata_device* dev) {
  OneTensor t = MakeOneTensor(dev, 1 << 16);
  Monitor m = {.opt = t.opt, .backwards = 0, .reads = 0};
  atomic_init(&m.stop, 0);
  pthread_t watcher;
  EXPECT(pthread_create(&watcher, NULL, Watch, &m) == 0);
  for (int i = 0; i < 30; ++i) CHECK_OK(strata_optimizer_step(m.opt));
  atomic_store(&m.stop, 1);
  pthread_join(watcher, NULL);
  EXPECT(m.backwards == 0);
  EXPECT(strata_optimizer_step_count(m.opt) == 30);
  printf("monitor thread: %d reads beside 30 steps\n", m.reads);
  /* A step over non-finite gradients is skipped and says how many it saw. */
  t.g[3] = NAN;
  t.g[7] = INFINITY;
  CHECK_OK(strata_optimizer_step(m.opt));
  strata_step_stats stats;
  CHECK_OK(strata_optimizer_last_step(m.opt, &stats, sizeof stats));
  EXPECT(stats.skipped == 1 && strata_optimizer_step_count(m.opt) == 30);
  EXPECT(strata_optimizer_last_step_nonfinite(m.opt) == 2);
  EXPECT(strata_optimizer_last_step_nonfinite(NULL) == 0);
  FreeOneTensor(&t);
}

/* Gradient accumulation from the trainer's CPU code on the host device: each
 * micro-step writes the grad again, so reduce_gradients returns once it has
 * read it (the later micro-steps' values were summed: 7 or 9, not 6). */
static void AccumulationReadsEachMicroStep(strata_device* dev) {
  enum { kN = 1 << 20 };
  float* w = calloc(kN, sizeof(float));
  float* g = calloc(kN, sizeof(float));
  strata_param p = {"w", w, g, kN, 0};
  strata_optimizer* opt = NULL;
  CHECK_OK(strata_optimizer_create(dev, NULL, NULL, "{\"gradient_clipping\": 0}", &p, 1, NULL, 1,
                                   &opt));
  for (int k = 0; k < 3; ++k) {
    for (int i = 0; i < kN; ++i) g[i] = (float)(k + 1);
    CHECK_OK(strata_optimizer_reduce_gradients(opt));
  }
  CHECK_OK(strata_optimizer_step(opt));
  strata_step_stats st;
  CHECK_OK(strata_optimizer_last_step(opt, &st, sizeof st));
  EXPECT(st.micro_steps == 3);
  EXPECT(fabs(st.grad_norm / sqrt((double)kN) - 6.0) < 1e-6);
  strata_optimizer_free(opt);
  free(w);
  free(g);
}

/* A backward that adds into the grad tensors: zero_grad_tensors clears them
 * between micro-steps and keeps what reduce_gradients summed (1 + 2 = 3 per
 * element); zero_grad drops it, so the step takes the grad tensors alone. */
static void AccumulationWithABackwardThatAdds(strata_device* dev) {
  enum { kN = 4096 };
  float* w = calloc(kN, sizeof(float));
  float* g = calloc(kN, sizeof(float));
  strata_param p = {"w", w, g, kN, 0};
  strata_optimizer* opt = NULL;
  CHECK_OK(
      strata_optimizer_create(dev, NULL, NULL, "{\"gradient_clipping\": 0}", &p, 1, NULL, 1, &opt));
  strata_step_stats st;
  for (int k = 0; k < 2; ++k) {
    for (int i = 0; i < kN; ++i) g[i] += (float)(k + 1);
    CHECK_OK(strata_optimizer_reduce_gradients(opt));
    CHECK_OK(strata_optimizer_zero_grad_tensors(opt));
    EXPECT(g[0] == 0.0f && g[kN - 1] == 0.0f);
  }
  CHECK_OK(strata_optimizer_step(opt));
  CHECK_OK(strata_optimizer_last_step(opt, &st, sizeof st));
  EXPECT(st.micro_steps == 2);
  EXPECT(fabs(st.grad_norm / sqrt((double)kN) - 3.0) < 1e-6);
  for (int i = 0; i < kN; ++i) g[i] += 1.0f;
  CHECK_OK(strata_optimizer_reduce_gradients(opt));
  CHECK_OK(strata_optimizer_zero_grad(opt));
  for (int i = 0; i < kN; ++i) g[i] = 5.0f;
  CHECK_OK(strata_optimizer_step(opt));
  CHECK_OK(strata_optimizer_last_step(opt, &st, sizeof st));
  EXPECT(st.micro_steps == 1);
  EXPECT(fabs(st.grad_norm / sqrt((double)kN) - 5.0) < 1e-6);
  EXPECT(strata_optimizer_zero_grad_tensors(NULL) == STRATA_INVALID_ARGUMENT);
  strata_optimizer_free(opt);
  free(w);
  free(g);
}

/* strata_step_stats as a caller built against an older header knew it: the
 * fields up to h2d_bytes. */
typedef struct {
  int64_t step;
  int32_t skipped;
  double loss_scale;
  double grad_norm;
  float clip_coef;
  uint32_t micro_steps;
  double d2h_sec, comm_sec, read_sec, adam_sec, write_sec, h2d_sec, step_sec;
  double grad_stats_sec;
  double device_sec;
  uint64_t read_bytes, write_bytes, d2h_bytes, h2d_bytes;
} StepStatsV1;

/* strata_step_stats only grows at its end. An older caller's struct gets its
 * fields and nothing past them; a newer caller's bytes this library does not
 * know come back zero; a size short of the first fields is refused. The
 * later fields are filled: after two NVMe steps, extents were still in their
 * buffers. */
static void StepStatsSizes(strata_device* dev, const char* nvme_dir) {
  float* w = calloc(kW, sizeof(float));
  float* g = calloc(kW, sizeof(float));
  unsigned seed = 7;
  for (int i = 0; i < kW; ++i) w[i] = Rand(&seed);
  strata_param p = {"w", w, g, kW, 0};
  char config[512];
  snprintf(config, sizeof config,
           "{\"zero_optimization\": {\"sub_group_size\": 512, \"offload_optimizer\": "
           "{\"device\": \"nvme\", \"nvme_path\": \"%s\"}}}",
           nvme_dir);
  strata_optimizer* opt = NULL;
  CHECK_OK(strata_optimizer_create(dev, NULL, NULL, config, &p, 1, NULL, 1, &opt));
  for (int k = 0; k < 2; ++k) {
    for (int i = 0; i < kW; ++i) g[i] = Rand(&seed);
    CHECK_OK(strata_optimizer_step(opt));
  }
  strata_step_stats full;
  CHECK_OK(strata_optimizer_last_step(opt, &full, sizeof full));
  EXPECT(full.step == 2 && full.skipped == 0 && full.nonfinite_elems == 0);
  EXPECT(full.resident_bytes > 0);
  EXPECT(full.host_dram_bytes >= 24u * kW); /* at least the fp32 state in and out */

  union {
    StepStatsV1 s;
    unsigned char b[sizeof(StepStatsV1) + 16];
  } older;
  memset(older.b, 0xAB, sizeof older.b);
  CHECK_OK(strata_optimizer_last_step(opt, (strata_step_stats*)&older, sizeof(StepStatsV1)));
  EXPECT(memcmp(older.b, &full, sizeof(StepStatsV1)) == 0);
  int untouched = 1;
  for (size_t i = sizeof(StepStatsV1); i < sizeof older.b; ++i) untouched &= older.b[i] == 0xAB;
  EXPECT(untouched);

  union {
    strata_step_stats s;
    unsigned char b[sizeof(strata_step_stats) + 24];
  } newer;
  memset(newer.b, 0xAB, sizeof newer.b);
  CHECK_OK(strata_optimizer_last_step(opt, &newer.s, sizeof newer.b));
  EXPECT(memcmp(newer.b, &full, sizeof full) == 0);
  int zeroed = 1;
  for (size_t i = sizeof full; i < sizeof newer.b; ++i) zeroed &= newer.b[i] == 0;
  EXPECT(zeroed);

  EXPECT(strata_optimizer_last_step(opt, &full, 4) == STRATA_INVALID_ARGUMENT);
  EXPECT(strstr(strata_last_error(), "out_size 4") != NULL);
  strata_optimizer_free(opt);
  free(w);
  free(g);
}

int main(void) {
  strata_device* dev = NULL;
  CHECK_OK(strata_device_open("host", &dev));
  EXPECT(strcmp(strata_device_name(dev), "host") == 0);
  printf("strata %s on %s\n", strata_version(), strata_device_name(dev));

  TrainAndCompare(dev, "{\"gradient_clipping\": 0, \"optimizer\": {\"type\": \"AdamW\"}}");

  char dir[] = "/tmp/strata_c_test_XXXXXX";
  if (mkdtemp(dir) == NULL) {
    perror("mkdtemp");
    return 1;
  }
  char config[512];
  snprintf(config, sizeof config,
           "{\"gradient_clipping\": 0, \"zero_optimization\": {\"sub_group_size\": 512, "
           "\"offload_optimizer\": {\"device\": \"nvme\", \"nvme_path\": \"%s\"}}}",
           dir);
  TrainAndCompare(dev, config);
  char ckpt[600];
  snprintf(ckpt, sizeof ckpt, "%s/ckpt", dir);
  SaveLoad(dev, ckpt);
  Safety(dev, dir);
  Trace(dev, dir);
  StepStatsSizes(dev, dir);
  char cmd[700];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);

  Errors(dev);
  AccumulationReadsEachMicroStep(dev);
  AccumulationWithABackwardThatAdds(dev);
  TwoThreads(dev);
  MonitorThread(dev);
  Logging(dev);
  strata_device_free(dev);
  if (failures) {
    fprintf(stderr, "%d failure(s)\n", failures);
    return 1;
  }
  printf("all passed\n");
  return 0;
}
