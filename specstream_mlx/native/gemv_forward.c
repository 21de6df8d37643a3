/* Skinny matrix products: a few rows times a weight, at the memory bandwidth.
 *
 * MLX's CPU backend computes every matrix product with cblas_sgemm, also the products of
 * a decoding step (1 row times a weight) and of a speculative tree pass (2-45 rows).
 * Debian's OpenBLAS 0.3.21 and BLIS 0.9 run those through their general GEMM path, which
 * packs the weight and streams it well below the memory bandwidth (bench/blas.md): at 8
 * rows a SmolLM2 step's products took 64-74 ms against a 15-17 ms floor.
 *
 * Preloaded before the BLAS, this library takes cblas_sgemm. A row-major product of
 * 1 <= m <= SKINNY_MAX_ROWS rows by a weight stored (n x k) -- a linear layer, b
 * transposed -- or (k x n) -- attention's values -- runs here: every weight row is read
 * once from memory and used for all m rows of a while it sits in the L1 cache, so m
 * rows cost about what one costs until the arithmetic (m FMAs per weight) catches up
 * with the reads (on SmolLM2's shapes, 2-4 rows took what one row takes, 8 rows 1.3x). The n outputs are split
 * between a small pool of threads that spin briefly between products (a step issues
 * ~200 of them back to back) and then sleep. Every other call goes to the next library's
 * cblas_sgemm unchanged, as does every call on a CPU without AVX2 and FMA (one-row
 * products then to its cblas_sgemv).
 *
 * Where the CPU has AVX-512 the tiles use 16-lane vectors and take up to 48 rows. A product
 * of more rows (up to 192) by a small operand (attention's keys or values of one head) runs
 * here too, in blocks of rows the tiles take.
 *
 * Settings (read once): SPECSTREAM_SKINNY_THREADS (default: the online CPUs, at most 8),
 * SPECSTREAM_SKINNY_ROWS (default 48 with AVX-512, else 32; 0 or 1 turns the kernel off),
 * SPECSTREAM_SKINNY_MIN_ROWS=2 (one-row products to the library's GEMV),
 * SPECSTREAM_SKINNY_ISA=avx2 (AVX2 tiles even where AVX-512 is there),
 * SPECSTREAM_SKINNY_PARALLEL_MIN (weight elements from which a one-row product is split
 * between the threads; default 512K, 256K once the weights seen outgrow the last-level
 * cache; from two rows on half of it; products of 256K multiply-adds are split whatever
 * their weight, and a thin operand's, one head's keys, from 32K elements, 16K from two rows
 * on, whichever is less), SPECSTREAM_SKINNY_YIELD (0: a waiting worker pauses in its spin instead
 * of yielding), SPECSTREAM_SKINNY_SPIN_US (how long it spins before it sleeps; default 50),
 * SPECSTREAM_SKINNY_PREFETCH (nta, t0, t1 or off: how the next tile's weight rows are
 * prefetched; default t1; nta never at one row),
 * SPECSTREAM_SKINNY_KBLOCK (the depth block of long weights, default 512; 0: none),
 * SPECSTREAM_SKINNY_FUSED_ROWS (up to how many rows weights read stored are expanded in
 * registers rather than into a buffer, 1-9, default 9),
 * SPECSTREAM_SKINNY_AHEAD_KB (how much of the next weight a waiting worker reads ahead;
 * default 1024), SPECSTREAM_PRODUCTS (q16, the default: weights read stored are multiplied
 * by 16-bit activations taken as two planes of 8-bit codes; q8: by 8-bit activations; exact: by
 * the float32 activations; see "8-bit activations" below).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <immintrin.h>
#define HAVE_X86 1
#else
#define HAVE_X86 0
#endif

enum { ROW_MAJOR = 101 };
/* Products of more rows than a tile takes that still run here, in blocks: at most this many
 * rows, by an operand of at most this many elements (1 MB, in the L2 cache). */
enum { BLOCKED_MAX_ROWS = 192, BLOCKED_MAX_WEIGHT = 1 << 18 };
enum { NO_TRANS = 111, TRANS = 112 };
enum { SKINNY_MAX_ROWS = 48, MAX_THREADS = 8 };
/* Products smaller than this many weight elements (half as many from two rows on) run on
 * the calling thread alone: waking the pool costs more than it saves (attention's per-head
 * products). How small depends on where the weights are. A model whose weights fit in the
 * last-level cache reads them from there, and a worker that spins between such products
 * takes the core the host thread needs between tokens (demo-sql's fused gate/up, 360K
 * weights: 1,094-1,233 tok/s split against 1,395-1,497 alone): 512K. Once the weights seen
 * outgrow that cache, every weight streams from memory at every step and two threads read
 * it faster than one (SmolLM2's 576 x 576 output projection: 24 us split against 40 alone;
 * the plain step 17.0 ms against 17.2 at 512K, examples/skinny_ab.sh): 256K. */
enum { PARALLEL_MIN_WEIGHTS = 512 * 1024, PARALLEL_MIN_STREAMING = 256 * 1024 };
/* ... or this many multiply-adds, whatever the weight: a tree pass's attention products
 * (27 query rows of a key/value head against 192 keys: 332K) are small weights but long
 * arithmetic, and split by key blocks between two threads their scores took 1.75 against
 * 2.44 ms a pass (320 keys: 2.8 against 4.6). */
enum { PARALLEL_MIN_WORK = 256 * 1024 };
/* ... or, for a thin operand (a depth or a width of at most a head dimension, KN_MAX_K: one
 * head's keys or values, or a low-rank factor), this many elements (half as many from two
 * rows on). A plain step's attention scores, a key/value head's query rows against its keys,
 * read the KV cache (SmolLM2's keys and values are 46 KB a token, as many bytes as its weights
 * at 2,500 tokens), and alone on the calling thread they read it at a fraction of the bus
 * rate; coming right after the q/k/v product, they find the worker still spinning. Split by
 * blocks of keys from 256 keys (at two rows and more), SmolLM2's plain step at a 1,000-token
 * context took 0.89x as long, at 512 tokens 0.95x (examples/lock_spin_ab.py --setting
 * thin-min, in one process, settings alternating). The product by the values has one item
 * (a head's width of outputs) and stays whole. */
enum { THIN_PARALLEL_MIN = 32 * 1024 };
static atomic_long thin_parallel_min = THIN_PARALLEL_MIN; /* specstream_skinny_set_thin_min */
/* How long an idle worker spins for the next product before it sleeps, microseconds
 * (SPECSTREAM_SKINNY_SPIN_US). */
static double spin_us = 50.0;
/* Outputs per work item: threads take items from the two ends of a shared count. */
enum { ITEM_ROWS = 64 };

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int, float,
                         float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *, int, float, float *, int);

static sgemm_fn next_sgemm;
static sgemv_fn next_sgemv;

/* Reports that the forwarding is in place (for `specstream-mlx doctor`). */
int specstream_gemv_forward(void) { return 1; }

/* The next library's symbol: after this one in the preload order (LD_PRELOAD), or, when
 * loaded in-process with dlopen (where RTLD_NEXT sees only this library's own
 * dependencies), from the BLAS that SPECSTREAM_GEMV_NEXT names. */
static void *next_symbol(const char *name) {
  void *f = dlsym(RTLD_NEXT, name);
  const char *lib = getenv("SPECSTREAM_GEMV_NEXT");
  if (!f && lib) {
    void *h = dlopen(lib, RTLD_LAZY | RTLD_NOLOAD);
    if (h)
      f = dlsym(h, name);
  }
  if (!f) {
    fprintf(stderr, "specstream-mlx: the product forwarder found no %s to forward to\n", name);
    abort();
  }
  return f;
}

/* ---- the kernel --------------------------------------------------------------------- */

/* One product: c[i, j] = alpha * sum_k a[i, k] * b'[k, j] + beta * c[i, j], where b' is
 * b[j, k] (trans_b: a weight stored (n x k), a linear layer) or b[k, j] (attention's
 * probabilities times values). */
typedef struct {
  int trans_b;
  int m, n, k, lda, ldb, ldc;
  float alpha, beta;
  const float *a, *b;
  float *c;
  const struct stored_weight *stored; /* b's stored form, read instead of b (or NULL) */
  /* With 8-bit activations (q8_product): a's rows quantized, k bytes a row, and per block of
   * 32 elements its scale and the sum of the values its codes stand for; NULL otherwise. */
  const int8_t *qa;
  const float *qd, *qs;
  /* How many rows of codes stand for one of a's rows: 1 (8-bit activations) or 2 (16-bit ones as
   * two planes of 8-bit codes, the high and the low byte: rows 2i and 2i + 1 of qa). */
  int planes;
} product_t;

#if HAVE_X86
__attribute__((target("avx2,fma"))) static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

static inline void store(const product_t *p, int i, int j, float v) {
  float *dst = p->c + (size_t)i * p->ldc + j;
  *dst = p->beta == 0.0f ? p->alpha * v : p->alpha * v + p->beta * *dst; /* beta 0: c may be garbage */
}

/* Weight rows ahead to prefetch: the next tile's. Without it, 4-8 rows took 1.5-1.8x
 * as long (the reads of one tile and the arithmetic of the last did not overlap). */
enum { PREFETCH = 4 };
/* How the next tile's rows are prefetched (SPECSTREAM_SKINNY_PREFETCH): into L2 (`t1`) at
 * every row count. On an Intel Xeon (Emerald Rapids) NTA prefetches made 9-13 rows twice as
 * slow as T1 (58 against 30 ms for SmolLM2's products at 9 rows; T0 1.15x) and one row took
 * 0.92x as long with T1 as without; on an AMD EPYC (Zen 4, family 25 model 17) every
 * product of a SmolLM2 step took 0.67-0.82x as long with T1 as with NTA from two rows on
 * and none at one (1 row 20.0 against 27.8 ms, 9 rows 22.6 against 32.8), T0 and NTA
 * within 7% of the latter (bench/skinny-prefetch-amd.md). Another EPYC host streamed one
 * row fastest with no prefetch and 2-13 rows 4-6% faster with NTA than T0: `nta` is its
 * choice. `t0` and `t1` prefetch at every row count, `nta` from two rows on,
 * `off` never. */
enum { PREFETCH_OFF = 0, PREFETCH_NTA = 1, PREFETCH_T0 = 2, PREFETCH_T1 = 3 };
static int prefetch_mode = PREFETCH_T1;
/* Weight rows per tile. */
enum { NR = 4 };

/* Every row of a in tiles of MR rows, then one tile of the rows left over (fewer than MR):
 * TILE(p, i0, j, mr, n) with a constant mr, so each tile's accumulators stay in registers;
 * tiles sized for MR rows are never called with more. */
#define ROW_TILES(TILE, MR, p, j, n)                                                                        \
  do {                                                                                                      \
    int i_ = 0;                                                                                             \
    for (; i_ + (MR) <= (p)->m; i_ += (MR))                                                                 \
      TILE(p, i_, j, MR, n);                                                                                \
    switch ((p)->m - i_) {                                                                                  \
    case 5: if ((MR) > 5) TILE(p, i_, j, (MR) > 5 ? 5 : 1, n); break;                                       \
    case 4: if ((MR) > 4) TILE(p, i_, j, (MR) > 4 ? 4 : 1, n); break;                                       \
    case 3: if ((MR) > 3) TILE(p, i_, j, (MR) > 3 ? 3 : 1, n); break;                                       \
    case 2: if ((MR) > 2) TILE(p, i_, j, (MR) > 2 ? 2 : 1, n); break;                                       \
    case 1: TILE(p, i_, j, 1, n); break;                                                                    \
    }                                                                                                       \
  } while (0)

/* The kernel for one vector width: the loop is the same for AVX2 and AVX-512, only the
 * vector type and its intrinsics differ, so one macro writes both.
 *
 * tile_ISA: rows i0..i0+mr-1 of a against weight rows j0..j0+nr-1, mr*nr accumulators,
 * the weight vectors loaded once per step for all rows. Always inlined with constant mr
 * and nr, so the accumulators live in registers.
 * rows_ISA: every row of a against weight rows j..j+nr-1, in tiles of MR rows. Tiles of
 * 3 x 4 were the fastest AVX2 shape of 2x4, 3x4, 4x3 and 4x2 at 1-32 rows on SmolLM2's
 * shapes (12 accumulators + 4 weight vectors: the 16 registers); AVX-512's 32 registers
 * take 6 x 4 (24 accumulators). */
#define DEFINE_TILES(ISA, TARGET, VEC, LANES, MR, ZERO, LOAD, FMA, SUM)                                    \
  __attribute__((target(TARGET), always_inline)) static inline void tile_##ISA(const product_t *p, int i0,    \
                                                                                int j0, const int mr,       \
                                                                                const int nr) {             \
    VEC acc[6][NR];                                                                                         \
    const float *ar[6], *br[NR];                                                                            \
    for (int r = 0; r < mr; r++) {                                                                          \
      ar[r] = p->a + (size_t)(i0 + r) * p->lda;                                                             \
      for (int s = 0; s < nr; s++)                                                                          \
        acc[r][s] = ZERO();                                                                                 \
    }                                                                                                       \
    for (int s = 0; s < nr; s++)                                                                            \
      br[s] = p->b + (size_t)(j0 + s) * p->ldb;                                                             \
    int kv = p->k & ~(LANES - 1), kk = 0;                                                                   \
    const int pf = p->m > 1 || prefetch_mode != PREFETCH_NTA ? prefetch_mode : PREFETCH_OFF;                \
    for (; kk < kv; kk += LANES) {                                                                          \
      VEC bv[NR];                                                                                           \
      for (int s = 0; s < nr; s++) {                                                                        \
        bv[s] = LOAD(br[s] + kk);                                                                           \
        const char *ahead = (const char *)(br[s] + kk + PREFETCH * p->ldb);                                 \
        if (pf == PREFETCH_NTA)                                                                             \
          _mm_prefetch(ahead, _MM_HINT_NTA);                                                                \
        else if (pf == PREFETCH_T0)                                                                         \
          _mm_prefetch(ahead, _MM_HINT_T0);                                                                 \
        else if (pf == PREFETCH_T1)                                                                         \
          _mm_prefetch(ahead, _MM_HINT_T1);                                                                 \
      }                                                                                                     \
      for (int r = 0; r < mr; r++) {                                                                        \
        VEC av = LOAD(ar[r] + kk);                                                                          \
        for (int s = 0; s < nr; s++)                                                                        \
          acc[r][s] = FMA(av, bv[s], acc[r][s]);                                                            \
      }                                                                                                     \
    }                                                                                                       \
    for (int r = 0; r < mr; r++)                                                                            \
      for (int s = 0; s < nr; s++) {                                                                        \
        float v = SUM(acc[r][s]);                                                                           \
        for (int t = kk; t < p->k; t++)                                                                     \
          v += ar[r][t] * br[s][t];                                                                         \
        store(p, i0 + r, j0 + s, v);                                                                        \
      }                                                                                                     \
  }                                                                                                         \
  __attribute__((target(TARGET), always_inline)) static inline void rows_##ISA(const product_t *p, int j,     \
                                                                                const int nr) {             \
    ROW_TILES(tile_##ISA, MR, p, j, nr);                                                                    \
  }                                                                                                         \
  __attribute__((target(TARGET))) static void rows4_##ISA(const product_t *p, int j) { rows_##ISA(p, j, NR); } \
  __attribute__((target(TARGET))) static void rows1_##ISA(const product_t *p, int j) { rows_##ISA(p, j, 1); }

DEFINE_TILES(avx2, "avx2,fma", __m256, 8, 3, _mm256_setzero_ps, _mm256_loadu_ps, _mm256_fmadd_ps, hsum)
DEFINE_TILES(avx512, "avx512f", __m512, 16, 6, _mm512_setzero_ps, _mm512_loadu_ps, _mm512_fmadd_ps,
             _mm512_reduce_add_ps)

static int use_avx512;

/* Rows of a thin operand stored (k x n) prefetched ahead in the kn tiles: a plain step's
 * probabilities by one head's values read a few hundred KB at long contexts from memory, with
 * a dozen multiply-adds per 256-byte row, faster than the hardware prefetcher fetches them
 * alone: 3 x 1,024 x 64 took 24 against 32-36 us with 32 rows ahead, 27 rows 45 against
 * 60-63, each product by the next of 1,200 distinct value blocks (examples/thin_products.py,
 * twice, alternating with the kernel without). KN_MAX_K: the most a thin operand's
 * short side holds (a head dimension). */
enum { KN_AHEAD = 32, KN_MAX_K = 128 };

/* b stored (k x n), one macro for both vector widths as above: rows i0..i0+mr-1 times
 * columns j0..j0+LANES*nv-1, each column block a vector accumulator, every a value
 * broadcast (mr*nv accumulators + nv b vectors). kn4_ISA takes 4 vectors of columns, kn1_ISA
 * one. AVX2 tiles take 2 rows (8 accumulators); AVX-512 tiles 6 rows (24), so a 64-wide
 * block (attention's head dimension) is one tile. */
#define DEFINE_KN_TILES(ISA, TARGET, VEC, LANES, MR, ZERO, LOAD, SET1, FMA, STOREU)                            \
  __attribute__((target(TARGET), always_inline)) static inline void tile_kn_##ISA(const product_t *p, int i0, \
                                                                                 int j0, const int mr,      \
                                                                                 const int nv) {            \
    VEC acc[MR][4];                                                                                         \
    const float *ar[MR];                                                                                    \
    for (int r = 0; r < mr; r++) {                                                                          \
      ar[r] = p->a + (size_t)(i0 + r) * p->lda;                                                             \
      for (int s = 0; s < nv; s++)                                                                          \
        acc[r][s] = ZERO();                                                                                 \
    }                                                                                                       \
    /* A head's values (ldb = the head dimension), more rows than a transposed block (which is in  \
     * L1 already): rows ahead, from memory (see KN_AHEAD). */                                              \
    const size_t ahead = p->ldb <= KN_MAX_K && p->k > KN_MAX_K ? (size_t)KN_AHEAD * p->ldb : 0;             \
    for (int kk = 0; kk < p->k; kk++) {                                                                     \
      const float *brow = p->b + (size_t)kk * p->ldb + j0;                                                  \
      VEC bv[4];                                                                                            \
      for (int s = 0; s < nv; s++) {                                                                        \
        bv[s] = LOAD(brow + LANES * s);                                                                     \
        if (ahead)                                                                                          \
          _mm_prefetch((const char *)(brow + LANES * s + ahead), _MM_HINT_T0);                              \
      }                                                                                                     \
      for (int r = 0; r < mr; r++) {                                                                        \
        VEC av = SET1(ar[r][kk]);                                                                           \
        for (int s = 0; s < nv; s++)                                                                        \
          acc[r][s] = FMA(av, bv[s], acc[r][s]);                                                            \
      }                                                                                                     \
    }                                                                                                       \
    float out[LANES];                                                                                       \
    for (int r = 0; r < mr; r++)                                                                            \
      for (int s = 0; s < nv; s++) {                                                                        \
        STOREU(out, acc[r][s]);                                                                             \
        for (int t = 0; t < LANES; t++)                                                                     \
          store(p, i0 + r, j0 + LANES * s + t, out[t]);                                                     \
      }                                                                                                     \
  }                                                                                                         \
  __attribute__((target(TARGET), always_inline)) static inline void kn_##ISA(const product_t *p, int j,      \
                                                                            const int nv) {                 \
    ROW_TILES(tile_kn_##ISA, MR, p, j, nv);                                                                 \
  }                                                                                                         \
  __attribute__((target(TARGET))) static void kn4_##ISA(const product_t *p, int j) { kn_##ISA(p, j, 4); }    \
  __attribute__((target(TARGET))) static void kn1_##ISA(const product_t *p, int j) { kn_##ISA(p, j, 1); }

DEFINE_KN_TILES(avx2, "avx2,fma", __m256, 8, 2, _mm256_setzero_ps, _mm256_loadu_ps, _mm256_set1_ps, _mm256_fmadd_ps,
                _mm256_storeu_ps)
DEFINE_KN_TILES(avx512, "avx512f", __m512, 16, 6, _mm512_setzero_ps, _mm512_loadu_ps, _mm512_set1_ps,
                _mm512_fmadd_ps, _mm512_storeu_ps)

/* Columns [j, j1) of a b stored (k x n) in AVX-512 tiles of 64 columns, then 16; returns the
 * first column not done (fewer than 16 are left). */
static int kn_columns_avx512(const product_t *p, int j, int j1) {
  for (; j + 64 <= j1; j += 64)
    kn4_avx512(p, j);
  for (; j + 16 <= j1; j += 16)
    kn1_avx512(p, j);
  return j;
}

/* Depth blocks: a weight stored (n x k) with a long k (SmolLM2's down projection, k = 1536)
 * is multiplied in blocks of k_block columns, each block's partial sums added into c, so that
 * the rows of a being multiplied stay in the L1 cache beside the weight rows of a tile (9 rows
 * of 1536 floats are 55 KB, more than the 48 KB of an Intel Xeon's L1; in blocks of 512, 18 KB).
 * Blocked by k alone, never by the row count, so every row's output takes the same arithmetic
 * in a product of one row and of many (a tree pass's logits stay those of plain steps, bit for
 * bit). On an Intel Xeon (Emerald Rapids) a 576 x 1536 product of 9 rows took 127-138 us
 * against 152-155 us, 13 rows 166-188 against 200 (60 weights in turn, two threads), and one
 * row the same. SPECSTREAM_SKINNY_KBLOCK: the block (default 512; 0: none); depths up to one
 * and a half blocks are not split. */
static int k_block = 512;

/* Columns [j, j1) of a weight stored (n x k), in the row tiles. A weight with a short k too
 * (attention's keys, k = the head dimension) takes them at every row count, so that a row's
 * outputs are the same bits in a product of one row and of many: a tree pass's scores
 * (several query rows of a key/value head) are then exactly a plain step's, and so are its
 * logits along the accepted path, and greedy speculative decoding reproduces plain decoding
 * bit for bit. Keys transposed into a buffer by blocks of 64 and multiplied with the outputs
 * in vector lanes (each score one chain of k multiply-adds, where the row tiles sum 16 lanes
 * of partial sums) are faster from 4 rows on -- at a 1,024-key context 27 rows 44-45 against
 * 65-71 us a product (examples/thin_products.py) -- but a pass's logits then differ from a
 * step's by up to 2e-5, which decides ties the other way (BFCL's parallel_multiple_73 under
 * dynamic:12, dynamic:16@1, dynamic:24) and lets 8-bit activations part from plain decoding
 * everywhere (bench/README.md). Summing the transposed block's lanes in the row tiles' order
 * (16 accumulators a row) gives the same bits no faster than the row tiles (59-66 us). */
static void row_columns(const product_t *p, int j, int j1) {
  void (*many)(const product_t *, int) = use_avx512 ? rows4_avx512 : rows4_avx2;
  void (*one)(const product_t *, int) = use_avx512 ? rows1_avx512 : rows1_avx2;
  for (; j + NR <= j1; j += NR)
    many(p, j);
  for (; j < j1; j++)
    one(p, j);
}

/* ---- weights read in their stored form ---------------------------------------------------
 *
 * On the CPU backend a quantized model's weights are expanded to float32 at load (MLX's own
 * 4-bit product there costs several float32 ones), so a step streams 4-8 times the bytes the
 * file stores: SmolLM2's 4-bit layers and 8-bit head are 98 MB stored and 538 MB expanded.
 * Where the loader registers a weight's stored form beside its float32 expansion
 * (specstream_stored_register), the kernel reads the stored form instead: each tile's weight
 * vectors are expanded in registers (w = q * scale + bias, MLX's affine quantization) and
 * multiplied exactly as the float32 tiles multiply them. Registration checks that every
 * expanded value equals the float32 weight bit for bit, and the products take the same
 * arithmetic as the float32 kernel's (the same lanes, depth blocks and sums), so the outputs
 * are the same bits either way; only the bytes read differ. A weight is found by the pointer
 * MLX passes (the float32 array's data, kept alive by the registrant while registered) and
 * its shape. */

struct stored_weight {
  const float *w; /* the float32 weight it stands for: the b that MLX passes */
  int n, k, bits, group;
  const uint8_t *q; /* row j's k elements at q + j * row_bytes, the low bits first */
  size_t row_bytes;
  const float *scales, *biases; /* row j's k / group of each at j * (k / group) */
  /* The same scales and biases as float16, owned, where every one of them is exactly a float16
   * (a GGUF file's are): what products read then (widened by half_groups), a sixth fewer bytes of a
   * four-bit weight with groups of 32 than with float32 ones; or NULL. */
  uint16_t *scales16, *biases16;
  int group_shift;              /* log2(group): an element's group is kk >> group_shift */
  uint8_t *packed; /* four-bit codes in the order the register loops read (pack), owned; or NULL */
  int exact;       /* every code times its scale is exact in float32 (exact_products) */
  /* Products of more rows read the float32 weight (specstream_stored_set_rows): where the
   * stored form's expansion, paid once per weight vector whatever the rows, costs more than
   * streaming the float32 bytes, which the rows' multiply-adds hide once there are enough of
   * them. Measured per machine by the registrant (runtime/stored_rows.py). */
  atomic_int max_rows;
  /* The codes, scales and biases in the 8-bit-activation layout (q8_pack), owned; or NULL. The
   * scales and biases are float16 where scales16 is set, else float32. */
  uint8_t *q8;
  void *q8_scales, *q8_biases;
};

enum { STORED_SLOTS = 4096, STORED_BITS = 12 };
static struct stored_weight *_Atomic stored_table[STORED_SLOTS];
static struct stored_weight stored_gone; /* a removed entry: lookups probe on past it */
static pthread_mutex_t stored_lock = PTHREAD_MUTEX_INITIALIZER;
static atomic_int stored_count;
static atomic_llong stored_served; /* products served from stored forms, all told */
/* Whether registration keeps scales and biases that are all exactly float16 as float16
 * (specstream_stored_half_set, for A/B in one process): the same values, fewer bytes a step. */
static atomic_int stored_half = 1;

/* Bytes of one of s's scales or biases as the kernel holds them. */
static inline size_t held_width(const struct stored_weight *s) {
  return s->scales16 ? sizeof(uint16_t) : sizeof(float);
}

/* A weight's first slot: its cache line's number, Fibonacci-hashed. */
static inline size_t stored_slot(const float *w) { return ((size_t)w >> 6) * 0x9E3779B97F4A7C15ull >> (64 - STORED_BITS); }

/* The stored form registered for the weight b of n x k (a row-major ldb = k), or NULL. Read
 * without the lock: entries are published whole and freed only once unregistered, which the
 * registrant does when nothing can use the weight any more. */
static const struct stored_weight *find_stored(const float *b, int n, int k, int ldb) {
  if (atomic_load_explicit(&stored_count, memory_order_relaxed) == 0)
    return NULL;
  size_t h = stored_slot(b);
  for (int i = 0; i < STORED_SLOTS; i++) {
    struct stored_weight *e = atomic_load_explicit(&stored_table[(h + i) % STORED_SLOTS], memory_order_acquire);
    if (e == NULL)
      return NULL;
    if (e != &stored_gone && e->w == b)
      return e->n == n && e->k == k && ldb == k ? e : NULL;
  }
  return NULL;
}

/* The stored form s (found by find_stored, or NULL) a product of m rows reads as stored, or
 * NULL: the float32 weight where none is registered or, from more rows on than it is read
 * stored, the same bits faster. */
static const struct stored_weight *stored_for(const struct stored_weight *s, int m) {
  return s && m <= atomic_load_explicit(&s->max_rows, memory_order_relaxed) ? s : NULL;
}

static void product_columns(const product_t *p, int j0, int j1);

/* Scale and bias i of s (row j's groups start at j * k / group), as float32: from the float16
 * copies where registration made them (the same values). */
__attribute__((target("f16c"), always_inline)) static inline float stored_scale(
    const struct stored_weight *s, size_t i) {
  return s->scales16 ? _cvtsh_ss(s->scales16[i]) : s->scales[i];
}
__attribute__((target("f16c"), always_inline)) static inline float stored_bias(
    const struct stored_weight *s, size_t i) {
  return s->biases16 ? _cvtsh_ss(s->biases16[i]) : s->biases[i];
}

/* Scaled and offset in two roundings, as MLX expands them: never contracted into one
 * multiply-add (the compiler may, where the target has FMA). */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

/* Float16 scales and biases i..i+15 of s, widened into sc and bi (the copies are padded: 16
 * can be read from any index). */
__attribute__((target("avx2,f16c"), always_inline)) static inline void half_groups(const struct stored_weight *s,
                                                                                 size_t i, float *sc, float *bi) {
  _mm256_storeu_ps(sc, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s->scales16 + i))));
  _mm256_storeu_ps(sc + 8, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s->scales16 + i + 8))));
  _mm256_storeu_ps(bi, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s->biases16 + i))));
  _mm256_storeu_ps(bi + 8, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s->biases16 + i + 8))));
}

/* The register loops' float16 scales and biases: where group g is past the 16 that sc and bi hold
 * for each of the nr weight rows (row r's groups start at first[r]; *base is the group at
 * sc[r][0]), the next 16 from g widened into them (the copies are padded: 16 from any group can
 * be read). */
__attribute__((target("avx2,f16c"), always_inline)) static inline void half_rows(const struct stored_weight *s,
                                                                               const size_t *first, int nr, int g,
                                                                               int *base, float (*sc)[16],
                                                                               float (*bi)[16]) {
  if (g < *base + 16)
    return;
  *base = g;
  for (int r = 0; r < nr; r++)
    half_groups(s, first[r] + g, sc[r], bi[r]);
}

/* Expands elements [k0, k1) of row j into dst (k0 and k1 multiples of 16, as registration
 * ensures): the integers widened in element order (four-bit ones two to a byte, the low
 * nibble first), converted, scaled and offset by their group's scale and bias. Sixteen
 * elements at a time, from 8 bytes (four bits) split into their nibbles, interleaved in
 * order, or from 16 bytes (eight bits). */
#define DEFINE_EXPAND(ISA, TARGET, VEC, LANES, WIDEN, CVT, SCALE, SET1, STOREU, ZERO, LOADF, FMA, SUM)           \
  /* sc and bi hold the scales and biases of groups from gbase on (kk's is kk >> shift). */                      \
  __attribute__((target(TARGET), always_inline)) static inline void expand16_##ISA(                                \
      const uint8_t *row, const float *sc, const float *bi, int gbase, int shift, int kk, VEC *out,              \
      const int bits, const int exact) {                                                                          \
    __m128i bytes;                                                                                                \
    if (bits == 4) {                                                                                              \
      const __m128i low4 = _mm_set1_epi8(15);                                                                     \
      __m128i x = _mm_loadl_epi64((const __m128i *)(row + (unsigned)kk / 2));                                     \
      bytes = _mm_unpacklo_epi8(_mm_and_si128(x, low4), _mm_and_si128(_mm_srli_epi16(x, 4), low4));              \
    } else {                                                                                                      \
      bytes = _mm_loadu_si128((const __m128i *)(row + kk));                                                       \
    }                                                                                                             \
    int g = (int)((unsigned)kk >> shift) - gbase;                                                                 \
    VEC scale = SET1(sc[g]), bias = SET1(bi[g]);                                                                  \
    VEC q0 = CVT(WIDEN(bytes));                                                                                   \
    out[0] = exact ? FMA(q0, scale, bias) : SCALE(q0, scale, bias);                                               \
    if (LANES < 16) {                                                                                             \
      VEC q1 = CVT(WIDEN(_mm_srli_si128(bytes, 8)));                                                              \
      out[LANES < 16] = exact ? FMA(q1, scale, bias) : SCALE(q1, scale, bias);                                    \
    }                                                                                                             \
  }                                                                                                               \
  __attribute__((target(TARGET))) static void expand_##ISA(const struct stored_weight *s, int j, int k0, int k1,   \
                                                            float *dst) {                                         \
    const uint8_t *row = s->q + (size_t)j * s->row_bytes;                                                         \
    const size_t first = ((size_t)j * s->k) >> s->group_shift;                                                    \
    const int shift = s->group_shift;                                                                             \
    float sbuf[16], bbuf[16];                                                                                     \
    const float *sc = s->scales + first, *bi = s->biases + first;                                                 \
    int base = 0;                                                                                                 \
    VEC v[16 / LANES];                                                                                            \
    for (int kk = k0; kk < k1; kk += 16) {                                                                        \
      int g = (int)((unsigned)kk >> shift);                                                                       \
      if (s->scales16 && (kk == k0 || g >= base + 16)) {                                                          \
        half_groups(s, first + g, sbuf, bbuf);                                                                    \
        sc = sbuf, bi = bbuf, base = g;                                                                           \
      }                                                                                                           \
      if (s->bits == 4)                                                                                           \
        expand16_##ISA(row, sc, bi, base, shift, kk, v, 4, s->exact);                                             \
      else                                                                                                        \
        expand16_##ISA(row, sc, bi, base, shift, kk, v, 8, s->exact);                                             \
      for (int h = 0; h < 16 / LANES; h++)                                                                        \
        STOREU(dst + (kk - k0) + h * LANES, v[h]);                                                                \
    }                                                                                                             \
  }                                                                                                               \
  /* One row of a: each weight vector expanded and multiplied in registers, in the float32 tile's     \
   * order (per output, one accumulator over the depth in steps of LANES, then its sum). The next     \
   * tile's codes are prefetched: an eight-bit 3,072 x 576 product took 61-78 us against 157-195      \
   * (the fastest of 40 rounds over 40 weights, three runs each); into L2 rather than L1: on an AMD    \
   * EPYC (Zen 4) SmolLM2's eight-bit head at one row took 1.53-1.76 against 1.81-2.04 ms            \
   * (examples/step_products.py, four rounds alternating). Float16 scales and biases (half) are       \
   * widened 16 groups at a time into the stack, read there as the registrant's float32 ones. */      \
  __attribute__((target(TARGET), always_inline)) static inline void srow_##ISA(                                   \
      const product_t *p, int j, const int nr, int k0, int k1, const int bits, const int exact,                  \
      const int half) {                                                                                           \
    const struct stored_weight *s = p->stored;                                                                    \
    const uint8_t *row[NR];                                                                                       \
    const float *sc[NR], *bi[NR];                                                                                 \
    size_t first[NR];                                                                                             \
    float sbuf[NR][16], bbuf[NR][16];                                                                             \
    int base = half ? INT_MIN / 2 : 0;                                                                            \
    VEC acc[NR];                                                                                                  \
    for (int r = 0; r < nr; r++) {                                                                                \
      first[r] = ((size_t)(j + r) * s->k) >> s->group_shift;                                                      \
      row[r] = s->q + (size_t)(j + r) * s->row_bytes;                                                             \
      sc[r] = half ? sbuf[r] : s->scales + first[r];                                                              \
      bi[r] = half ? bbuf[r] : s->biases + first[r];                                                              \
      acc[r] = ZERO();                                                                                            \
    }                                                                                                             \
    for (int kk = k0; kk < k1; kk += 16) {                                                                        \
      VEC av[16 / LANES], w[16 / LANES];                                                                          \
      for (int h = 0; h < 16 / LANES; h++)                                                                        \
        av[h] = LOADF(p->a + kk + h * LANES);                                                                     \
      if (((unsigned)kk * bits / 8 & 63) == 0) /* the next NR rows' codes, a line at a time */                    \
        for (int r = 0; r < nr; r++)                                                                              \
          _mm_prefetch((const char *)(row[r] + (unsigned)kk * bits / 8 + NR * s->row_bytes), _MM_HINT_T1);        \
      if (half)                                                                                                   \
        half_rows(s, first, nr, (int)((unsigned)kk >> s->group_shift), &base, sbuf, bbuf);                       \
      for (int r = 0; r < nr; r++) {                                                                              \
        expand16_##ISA(row[r], sc[r], bi[r], base, s->group_shift, kk, w, bits, exact);                           \
        for (int h = 0; h < 16 / LANES; h++)                                                                      \
          acc[r] = FMA(av[h], w[h], acc[r]);                                                                      \
      }                                                                                                           \
    }                                                                                                             \
    for (int r = 0; r < nr; r++)                                                                                  \
      store(p, 0, j + r, SUM(acc[r]));                                                                            \
  }                                                                                                               \
  __attribute__((target(TARGET), always_inline)) static inline void srows_at_##ISA(                              \
      const product_t *p, int j, int j1, int k0, int k1, const int bits, const int exact, const int half) {       \
    for (; j + NR <= j1; j += NR)                                                                                 \
      srow_##ISA(p, j, NR, k0, k1, bits, exact, half);                                                            \
    for (; j < j1; j++)                                                                                           \
      srow_##ISA(p, j, 1, k0, k1, bits, exact, half);                                                             \
  }                                                                                                               \
  __attribute__((target(TARGET), always_inline)) static inline void srows_half_##ISA(                            \
      const product_t *p, int j, int j1, int k0, int k1, const int half) {                                        \
    const struct stored_weight *s = p->stored;                                                                    \
    if (s->bits == 4 && s->exact)                                                                                 \
      srows_at_##ISA(p, j, j1, k0, k1, 4, 1, half);                                                               \
    else if (s->bits == 4)                                                                                        \
      srows_at_##ISA(p, j, j1, k0, k1, 4, 0, half);                                                               \
    else if (s->exact)                                                                                            \
      srows_at_##ISA(p, j, j1, k0, k1, 8, 1, half);                                                               \
    else                                                                                                          \
      srows_at_##ISA(p, j, j1, k0, k1, 8, 0, half);                                                               \
  }                                                                                                               \
  __attribute__((target(TARGET))) static void srows_##ISA(const product_t *p, int j, int j1, int k0, int k1) {     \
    if (p->stored->scales16)                                                                                      \
      srows_half_##ISA(p, j, j1, k0, k1, 1);                                                                      \
    else                                                                                                          \
      srows_half_##ISA(p, j, j1, k0, k1, 0);                                                                      \
  }

__attribute__((target("avx2,fma"))) static inline __m256 scale_avx2(__m256 w, __m256 s, __m256 b) {
  return _mm256_add_ps(_mm256_mul_ps(w, s), b);
}
__attribute__((target("avx512f"))) static inline __m512 scale_avx512(__m512 w, __m512 s, __m512 b) {
  return _mm512_add_ps(_mm512_mul_ps(w, s), b);
}

DEFINE_EXPAND(avx2, "avx2,fma,f16c", __m256, 8, _mm256_cvtepu8_epi32, _mm256_cvtepi32_ps, scale_avx2, _mm256_set1_ps,
              _mm256_storeu_ps, _mm256_setzero_ps, _mm256_loadu_ps, _mm256_fmadd_ps, hsum)
DEFINE_EXPAND(avx512, "avx512f,f16c", __m512, 16, _mm512_cvtepu8_epi32, _mm512_cvtepi32_ps, scale_avx512,
              _mm512_set1_ps, _mm512_storeu_ps, _mm512_setzero_ps, _mm512_loadu_ps, _mm512_fmadd_ps,
              _mm512_reduce_add_ps)


/* The table of a group's 16 values: code * scale + bias in MLX's two roundings, or in one
 * multiply-add where every code times the scale is exact (the same values). */
__attribute__((target("avx512f"), always_inline)) static inline __m512 table16_avx512(float scale, float bias,
                                                                                     int exact) {
  const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 s = _mm512_set1_ps(scale), b = _mm512_set1_ps(bias);
  return exact ? _mm512_fmadd_ps(codes, s, b) : scale_avx512(codes, s, b);
}

/* One row by four-bit weights, AVX-512: the 16 values a group's codes stand for are one
 * register (table16_avx512), and each vector of weights is a permutation of it by its codes.
 * The codes are repacked at registration (pack) so that in each run of 32 elements byte i
 * holds element i's code in its low nibble and element i + 16's in its high one (MLX's order
 * holds elements 2i and 2i + 1): one widening of 16 bytes puts the first 16 codes in lane
 * order (the permutation reads only an index's low four bits), a shift the next 16. Per 32
 * elements a widening, a shift and two permutations, where gathering codes from MLX's order
 * took two shuffles, two shifts and two permutations: on an Intel Xeon (Emerald Rapids) one
 * row by a 3,072 x 576 weight streamed from memory took 54-81 us against 77-95
 * (examples/stored_ab.py; 42 us at the bus's rate). */
__attribute__((target("avx512f"), always_inline)) static inline void codes32_avx512(const uint8_t *at, __m512i *lo,
                                                                                   __m512i *hi) {
  __m128i b = _mm_loadu_si128((const __m128i *)at);
  *lo = _mm512_cvtepu8_epi32(b);
  *hi = _mm512_srli_epi32(*lo, 4); /* bits above the nibble are not read */
}

/* One row of a by weight rows j..j+nr-1 from their repacked codes, 32 elements a step: per
 * output one accumulator over the depth in steps of 16, as the float32 tile. Eight weight
 * rows at a time where there are eight: each output's sum is one chain of dependent FMAs,
 * and eight chains keep the FMA unit busy where four would wait on their latency. The next
 * tile's codes are prefetched (60 against 65 us for the product above). */
enum { PNR = 8 };
__attribute__((target("avx512f,f16c"), always_inline)) static inline void srow4_packed_avx512(
    const product_t *p, int j, const int nr, int k0, int k1, const int half) {
  const struct stored_weight *s = p->stored;
  const uint8_t *row[PNR];
  size_t first[PNR];
  __m512 acc[PNR], table[PNR];
  /* Float16 scales and biases widened 16 groups at a time (half): the loop then reads float32
   * ones from the stack as it reads the registrant's, where converting two values at every
   * group made a compute-bound one-row product 1.09x as long. */
  float sbuf[PNR][16], bbuf[PNR][16];
  int base = INT_MIN / 2; /* the group at sbuf[r][0] */
  for (int r = 0; r < nr; r++) {
    first[r] = ((size_t)(j + r) * s->k) >> s->group_shift;
    row[r] = s->packed + (size_t)(j + r) * s->row_bytes;
    acc[r] = table[r] = _mm512_setzero_ps();
  }
  unsigned group = ~0u;
  for (int kk = k0; kk < k1; kk += 32) {
    __m512 a0 = _mm512_loadu_ps(p->a + kk), a1 = _mm512_loadu_ps(p->a + kk + 16);
    unsigned g = (unsigned)kk >> s->group_shift;
    if (((unsigned)kk & 127) == 0) /* the next 8 rows' codes: one line for 4 steps */
      for (int r = 0; r < nr; r++)
        _mm_prefetch((const char *)(row[r] + (unsigned)kk / 2 + PNR * s->row_bytes), _MM_HINT_T0);
    if (half)
      half_rows(s, first, nr, (int)g, &base, sbuf, bbuf);
    for (int r = 0; r < nr; r++) {
      if (g != group)
        table[r] = half ? table16_avx512(sbuf[r][g - base], bbuf[r][g - base], s->exact)
                        : table16_avx512(s->scales[first[r] + g], s->biases[first[r] + g], s->exact);
      __m512i lo, hi;
      codes32_avx512(row[r] + (unsigned)kk / 2, &lo, &hi);
      acc[r] = _mm512_fmadd_ps(a0, _mm512_permutexvar_ps(lo, table[r]), acc[r]);
      acc[r] = _mm512_fmadd_ps(a1, _mm512_permutexvar_ps(hi, table[r]), acc[r]);
    }
    group = g;
  }
  for (int r = 0; r < nr; r++)
    store(p, 0, j + r, _mm512_reduce_add_ps(acc[r]));
}

__attribute__((target("avx512f,f16c"), always_inline)) static inline void srows4_packed_at_avx512(
    const product_t *p, int j, int j1, int k0, int k1, const int half) {
  for (; j + PNR <= j1; j += PNR)
    srow4_packed_avx512(p, j, PNR, k0, k1, half);
  for (; j + NR <= j1; j += NR)
    srow4_packed_avx512(p, j, NR, k0, k1, half);
  for (; j < j1; j++)
    srow4_packed_avx512(p, j, 1, k0, k1, half);
}

__attribute__((target("avx512f,f16c"))) static void srows4_packed_avx512(
    const product_t *p, int j, int j1, int k0, int k1) {
  if (p->stored->scales16)
    srows4_packed_at_avx512(p, j, j1, k0, k1, 1);
  else
    srows4_packed_at_avx512(p, j, j1, k0, k1, 0);
}

/* Two to FUSED_ROWS rows of a (a tree pass's) by weights read stored, AVX-512: each weight
 * vector is expanded in registers once (four-bit codes repacked, through the group's table;
 * eight-bit ones widened and scaled) and multiplied by every row, where expanding NR weight
 * rows into a buffer for the float32 tiles (stored_columns) took a pass over the values and
 * their stores more. Tiles of every row by 4 weight rows (up to 5 rows: 20 accumulators), 3
 * (up to 7: 21) or 2 (up to 9: 18); per output the float32 tile's accumulator, order and sum.
 * On an Intel Xeon (Emerald Rapids), 3,072 x 576 products streamed from memory (examples/stored_ab.py,
 * against SPECSTREAM_SKINNY_FUSED_ROWS=1, two runs each): four bits, 2 rows 71-75 against
 * 183-211 us, 3 rows 90-117 against 167-202, 5 rows 117-131 against 195-206, 9 rows 242-255
 * against 282-298; eight bits, 2 rows 113-140 against 166-216. The next tile's codes are
 * prefetched (eight bits, 5 rows: 122-126 against 213-236 us without; 2 rows 76-84 against
 * 92-127; four bits the same to 0.9x). Eight bits at 7 rows 234-238 against 249-255 us, at 9
 * 296-346 either way there; with the rows of a in registers (stile_avx512) on an AMD EPYC
 * (Zen 4), 8 rows 207-226 against 330-340 us, 9 rows 245-257 against 340-356 (two runs each,
 * against the buffer from 8 rows). From 10 rows the buffer pays at four bits too (its expansion
 * is shared by more rows: 45 rows took 1.59 ms in tiles of 10 against 1.08). SmolLM2's
 * step products (examples/step_products.py) at 2 rows took 6.5 ms against 13.3, at 5 rows
 * 10.3 against 15.3, at 9 rows 19.1 against 20.0. */
enum { FUSED_ROWS = 9 };
static int fused_rows = FUSED_ROWS; /* SPECSTREAM_SKINNY_FUSED_ROWS: 1 multiplies through the buffer */
__attribute__((target("avx512f,f16c"), always_inline)) static inline void stile_avx512(
    const product_t *p, int j, const int mr, const int nr, int k0, int k1, const int bits, const int exact,
    const int half) {
  const struct stored_weight *s = p->stored;
  const uint8_t *row[4];
  const float *ar[FUSED_ROWS];
  size_t first[4];
  __m512 acc[FUSED_ROWS][4], table[4];
  /* Float16 scales and biases widened 16 groups at a time into the stack (half), as the one-row
   * loop reads them, float32 ones read where they lie: the width chosen once per product. A
   * test of the width and a conversion at every group and weight row took GPRs the loop needed
   * (on an AMD EPYC, Zen 4, SmolLM2's step products in one process, 8 rounds alternating: 2
   * rows 0.90x, 5 rows 0.90x, 9 rows 0.97x as long without them). */
  float sbuf[4][16], bbuf[4][16];
  int base = INT_MIN / 2; /* the group at sbuf[t][0] */
  for (int t = 0; t < nr; t++) {
    first[t] = ((size_t)(j + t) * s->k) >> s->group_shift;
    row[t] = (bits == 4 ? s->packed : s->q) + (size_t)(j + t) * s->row_bytes;
    table[t] = _mm512_setzero_ps();
  }
  for (int r = 0; r < mr; r++) {
    ar[r] = p->a + (size_t)r * p->lda;
    for (int t = 0; t < nr; t++)
      acc[r][t] = _mm512_setzero_ps();
  }
  unsigned group = ~0u;
  for (int kk = k0; kk < k1; kk += 32) { /* groups of 32 or more: one group a step */
    unsigned g = (unsigned)kk >> s->group_shift;
    /* The next tile's codes, a line at a time: eight-bit ones into L2 (on an AMD EPYC, Zen 4,
     * 2 rows by a 3,072 x 576 weight 106-115 against 128-153 us into L1, examples/stored_ab.py,
     * three rounds alternating), four-bit ones into L1 (into L2 no faster there). */
    if (((unsigned)kk * bits / 8 & 63) == 0) {
      for (int t = 0; t < nr; t++) {
        if (bits == 8)
          _mm_prefetch((const char *)(row[t] + (unsigned)kk + nr * s->row_bytes), _MM_HINT_T1);
        else
          _mm_prefetch((const char *)(row[t] + (unsigned)kk / 2 + nr * s->row_bytes), _MM_HINT_T0);
      }
    }
    if (half)
      half_rows(s, first, nr, (int)g, &base, sbuf, bbuf);
    __m512 w0[4], w1[4];
    for (int t = 0; t < nr; t++) {
      const float scale1 = half ? sbuf[t][g - base] : s->scales[first[t] + g];
      const float bias1 = half ? bbuf[t][g - base] : s->biases[first[t] + g];
      if (bits == 4) {
        if (g != group)
          table[t] = table16_avx512(scale1, bias1, exact);
        __m512i lo, hi;
        codes32_avx512(row[t] + (unsigned)kk / 2, &lo, &hi);
        w0[t] = _mm512_permutexvar_ps(lo, table[t]);
        w1[t] = _mm512_permutexvar_ps(hi, table[t]);
      } else {
        __m512 scale = _mm512_set1_ps(scale1), bias = _mm512_set1_ps(bias1);
        __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row[t] + kk))));
        __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row[t] + kk + 16))));
        w0[t] = exact ? _mm512_fmadd_ps(q0, scale, bias) : scale_avx512(q0, scale, bias);
        w1[t] = exact ? _mm512_fmadd_ps(q1, scale, bias) : scale_avx512(q1, scale, bias);
      }
    }
    /* Each row's two vectors of a are loaded once into registers and multiplied by every
     * weight row's values; the empty asm keeps the compiler from folding them back into
     * one load per multiply-add. Folded (or kept with the accumulators), 9 rows by 2
     * weight rows took 36 loads a step or spilled 8 accumulators to the stack, and the
     * products of 6 to 9 rows ran 1.1-1.2x longer. */
    for (int r = 0; r < mr; r++) {
      __m512 a0 = _mm512_loadu_ps(ar[r] + kk), a1 = _mm512_loadu_ps(ar[r] + kk + 16);
      __asm__("" : "+v"(a0), "+v"(a1));
      for (int t = 0; t < nr; t++) {
        acc[r][t] = _mm512_fmadd_ps(a0, w0[t], acc[r][t]);
        acc[r][t] = _mm512_fmadd_ps(a1, w1[t], acc[r][t]);
      }
    }
    group = g;
  }
  for (int r = 0; r < mr; r++)
    for (int t = 0; t < nr; t++)
      store(p, r, j + t, _mm512_reduce_add_ps(acc[r][t]));
}

/* Weight rows j..j1-1 for mr rows of a, with mr, bits and exact constants. */
__attribute__((target("avx512f,f16c"), always_inline)) static inline void stiles_rows_avx512(
    const product_t *p, int j, int j1, int k0, int k1, const int mr, const int bits, const int exact,
    const int half) {
  /* The most weight rows whose accumulators (mr x nr), values (2 nr) and the rows of a (2)
   * fit AVX-512's 32 registers. */
  const int nr = mr <= 5 ? 4 : mr <= 7 ? 3 : 2;
  for (; j + nr <= j1; j += nr)
    stile_avx512(p, j, mr, nr, k0, k1, bits, exact, half);
  for (; j < j1; j++)
    stile_avx512(p, j, mr, 1, k0, k1, bits, exact, half);
}

__attribute__((target("avx512f,f16c"), always_inline)) static inline void stiles_bits_avx512(
    const product_t *p, int j, int j1, int k0, int k1, const int bits, const int exact, const int half) {
  switch (p->m) {
  case 2: stiles_rows_avx512(p, j, j1, k0, k1, 2, bits, exact, half); break;
  case 3: stiles_rows_avx512(p, j, j1, k0, k1, 3, bits, exact, half); break;
  case 4: stiles_rows_avx512(p, j, j1, k0, k1, 4, bits, exact, half); break;
  case 5: stiles_rows_avx512(p, j, j1, k0, k1, 5, bits, exact, half); break;
  case 6: stiles_rows_avx512(p, j, j1, k0, k1, 6, bits, exact, half); break;
  case 7: stiles_rows_avx512(p, j, j1, k0, k1, 7, bits, exact, half); break;
  case 8: stiles_rows_avx512(p, j, j1, k0, k1, 8, bits, exact, half); break;
  default: stiles_rows_avx512(p, j, j1, k0, k1, FUSED_ROWS, bits, exact, half); break;
  }
}

__attribute__((target("avx512f,f16c"), always_inline)) static inline void stiles_half_avx512(
    const product_t *p, int j, int j1, int k0, int k1, const int half) {
  const struct stored_weight *s = p->stored;
  if (s->bits == 4 && s->exact)
    stiles_bits_avx512(p, j, j1, k0, k1, 4, 1, half);
  else if (s->bits == 4)
    stiles_bits_avx512(p, j, j1, k0, k1, 4, 0, half);
  else if (s->exact)
    stiles_bits_avx512(p, j, j1, k0, k1, 8, 1, half);
  else
    stiles_bits_avx512(p, j, j1, k0, k1, 8, 0, half);
}

/* 2 to FUSED_ROWS rows: four-bit weights from repacked codes, eight-bit ones as stored. */
__attribute__((target("avx512f,f16c"))) static void stiles_avx512(const product_t *p, int j, int j1, int k0, int k1) {
  const struct stored_weight *s = p->stored;
  if (s->scales16)
    stiles_half_avx512(p, j, j1, k0, k1, 1);
  else
    stiles_half_avx512(p, j, j1, k0, k1, 0);
}

/* Elements [0, k) of row j from its repacked codes, as srow4_packed_avx512 expands them
 * (registration compares them with the float32 weight). */
__attribute__((target("avx512f,f16c"))) static void expand_packed_avx512(
    const struct stored_weight *s, int j, float *dst) {
  const uint8_t *row = s->packed + (size_t)j * s->row_bytes;
  const size_t first = ((size_t)j * s->k) >> s->group_shift;
  for (int kk = 0; kk < s->k; kk += 32) {
    unsigned g = (unsigned)kk >> s->group_shift;
    __m512 table = table16_avx512(stored_scale(s, first + g), stored_bias(s, first + g), s->exact);
    __m512i lo, hi;
    codes32_avx512(row + kk / 2, &lo, &hi);
    _mm512_storeu_ps(dst + kk, _mm512_permutexvar_ps(lo, table));
    _mm512_storeu_ps(dst + kk + 16, _mm512_permutexvar_ps(hi, table));
  }
}

#pragma GCC pop_options

static void expand(const struct stored_weight *s, int j, int k0, int k1, float *dst) {
  (use_avx512 ? expand_avx512 : expand_avx2)(s, j, k0, k1, dst);
}

/* Each thread's buffer of expanded weight rows (NR rows of one depth block). */
static __thread float *strip_buf;
static __thread size_t strip_cap;

static float *strip(size_t floats) {
  if (floats > strip_cap) {
    free(strip_buf);
    strip_buf = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
    strip_cap = strip_buf ? floats : 0;
  }
  return strip_buf;
}

/* ---- 8-bit activations (SPECSTREAM_PRODUCTS=q8; q16, the default, takes two planes) --------
 *
 * Read as stored, a 4-bit weight's products are bound by the expansion's arithmetic, not by
 * the bus (a permutation and a multiply-add per 16 weights and row; the 9-row tiles run at
 * ~66% of the multiply-add rate, bench/README.md). A product can instead take a's rows
 * quantized to 8 bits, as llama.cpp multiplies its Q4/Q8 files: per block of 32 elements of a
 * row a scale d = max|x| / 127 and codes round(x / d), and with AVX512-VNNI one integer
 * instruction (vpdpbusd) multiplies 64 weight codes by 4 activation codes each and sums them in
 * 16 lanes (with AVX2 alone, vpmaddubsw and vpmaddwd give the same integers: q8_tile_avx2). A
 * weight w = scale * q + bias then gives, per block,
 *   sum_k x_k w_k ~ scale * d * sum_k code_k q_k + bias * d * sum_k code_k,
 * both sums exact in integers. The outputs are no longer the float32 product's bits
 * (SmolLM2's next-token distributions move by a mean KL of ~3e-3 nats; with 16-bit activations,
 * q16 below, by ~1e-7, float32's own rounding noise), but they are the same bits whatever the
 * product's rows: a row's codes, scales and sums are
 * its own, and each output is summed block after block in one order by one thread. Every
 * product of such a weight, of any number of rows, runs here. A tree pass's main rows are a
 * plain step's bits before these products (attention's scores in the row tiles at every row
 * count), so their 8-bit codes are the step's too and greedy ss still reproduces ar: while a
 * pass's activations differed from a step's in their last bits, such a difference crossing a
 * rounding boundary changed a code, and greedy ss parted from ar in 4 of 6 SmolLM2 replies.
 *
 * The weight is repacked at registration (q8_pack) in blocks of 16 output rows: per block of
 * 32 elements, 4-bit codes as 4 chunks of 64 bytes, byte 4r + e of chunk c holding element
 * 4c + e of row r in its low nibble and element 16 + 4c + e in its high one (one load, a mask
 * and a shift give two instructions' operands), 8-bit codes as 8 chunks of 64 bytes (4
 * elements of each of the 16 rows); the scales and biases per block of 32, 16 rows side by
 * side. Rows past n (the last block) are zeros. */
enum { Q8_BLOCK = 32, Q8_ROWS = 16, Q8_TILE = 8, Q8_TILE_AVX2 = 4 };
static int q8_capable;      /* the kernel serves products (AVX2 and FMA): the layouts can be used */
static int q8_vnni;         /* AVX-512 with BW and VNNI: q8_tile; otherwise q8_tile_avx2 */
static int q8_wanted;       /* SPECSTREAM_PRODUCTS: exact (0), q8 (1) or q16 (2, the default) */
static atomic_int q8_on;    /* products use them: 0 off, 1 (8-bit), 2 (16-bit, two planes) */
static atomic_llong q8_served; /* products computed with 8-bit activations, all told */

/* Whether products of s (or NULL) take 8-bit activations now: its layout for them is built
 * and the setting is on. */
static int q8_reads(const struct stored_weight *s) {
  return s && s->q8 && atomic_load_explicit(&q8_on, memory_order_relaxed);
}

/* Planes of activation codes a product takes now (q8_on: 1 or 2; 1 if it went off meanwhile). */
static int q8_planes(void) { return atomic_load_explicit(&q8_on, memory_order_relaxed) == 2 ? 2 : 1; }

/* 16 (8) of the 8-bit-activation layout's scales or biases v of s from index i, as float32. */
__attribute__((target("avx512f"), always_inline)) static inline __m512 q8_values16(const struct stored_weight *s,
                                                                                 const void *v, size_t i) {
  return s->scales16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)v + i)))
                     : _mm512_loadu_ps((const float *)v + i);
}
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline __m256 q8_values8(
    const struct stored_weight *s, const void *v, size_t i) {
  return s->scales16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)v + i)))
                     : _mm256_loadu_ps((const float *)v + i);
}

/* A block's codes (four vectors of 8, in element order) as 32 bytes in element order. */
__attribute__((target("avx2"), always_inline)) static inline void q8_store_codes(int8_t *to, __m256i q0, __m256i q1,
                                                                                __m256i q2, __m256i q3) {
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  /* the packs work within 128-bit halves: dword l of the result holds codes 4(order[l])..+3 */
  __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q0, q1), _mm256_packs_epi32(q2, q3));
  _mm256_storeu_si256((__m256i *)to, _mm256_permutevar8x32_epi32(bytes, order));
}

__attribute__((target("avx2"), always_inline)) static inline int32_t q8_sum(__m256i q0, __m256i q1, __m256i q2,
                                                                           __m256i q3) {
  __m256i t = _mm256_add_epi32(_mm256_add_epi32(q0, q1), _mm256_add_epi32(q2, q3));
  int32_t parts[8], sum = 0;
  _mm256_storeu_si256((__m256i *)parts, t);
  for (int l = 0; l < 8; l++)
    sum += parts[l];
  return sum;
}

/* 16-bit activations (SPECSTREAM_PRODUCTS=q16) as two planes of 8-bit codes: per block a scale
 * d = max|x| / Q16_MAX, a code q = round(x / d) and its bytes h = (q + 128) >> 8, l = q - 256 h
 * (h in [-127, 127], l in [-128, 127]: both take vpdpbusd's and vpmaddubsw's signed operand as
 * the 8-bit codes do), rows 2i (scale 256 d) and 2i + 1 (scale d) of qa. The tiles multiply
 * them as two rows of 8-bit codes and add the two rows' outputs: one product's arithmetic per
 * plane, 2^8 times as fine a step as one plane's. (A low byte of -128 makes a vpmaddubsw pair at
 * most 2 * 15 * 128 and a block's 8 pairs 30,720: still exact in 16 bits.) Against the float32
 * products, one weight's outputs are ~3e-5 of the largest apart, 8-bit codes' ~1e-2
 * (tests/test_q8_products.py); SmolLM2's next-token distributions a mean KL of 1.0e-7 nats
 * (examples/q8_quality.py: many positions below zero, the float32 log-softmax's own rounding),
 * its greedy replies unchanged; a plain step takes what 8-bit codes take (its products stream
 * at the bus's rate either way), a tree pass's many rows twice their arithmetic. */
enum { Q16_MAX = 127 * 256 + 127 };

/* Quantizes rows [0, m) of a (k elements, k a multiple of 32) into qa (m * planes x k codes),
 * qd and qs (m * planes x k/32 scales and sums of the values the codes stand for). One
 * implementation for both tile paths (AVX2 is there wherever the kernel serves), so a row's
 * codes are the same whichever tiles multiply them; its cost is a small part of a product's
 * (k elements a row against the n x k weight). */
__attribute__((target("avx2,fma"))) static void q8_quantize(const float *a, int m, int lda, int k, int planes,
                                                            int8_t *qa, float *qd, float *qs) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const int blocks = k / Q8_BLOCK;
  for (int i = 0; i < m; i++)
    for (int kk = 0; kk < k; kk += Q8_BLOCK) {
      const float *x = a + (size_t)i * lda + kk;
      __m256 x0 = _mm256_loadu_ps(x), x1 = _mm256_loadu_ps(x + 8), x2 = _mm256_loadu_ps(x + 16),
             x3 = _mm256_loadu_ps(x + 24);
      __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, x0), _mm256_andnot_ps(sign, x1)),
                                _mm256_max_ps(_mm256_andnot_ps(sign, x2), _mm256_andnot_ps(sign, x3)));
      float lanes[8], amax = 0.0f;
      _mm256_storeu_ps(lanes, mx);
      for (int l = 0; l < 8; l++)
        amax = lanes[l] > amax ? lanes[l] : amax;
      const float top = planes == 2 ? (float)Q16_MAX : 127.0f;
      float d = amax / top, id = amax > 0.0f ? top / amax : 0.0f;
      __m256 vid = _mm256_set1_ps(id);
      /* round to nearest even (the default rounding mode); |x * id| <= top */
      __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(x0, vid)), q1 = _mm256_cvtps_epi32(_mm256_mul_ps(x1, vid)),
              q2 = _mm256_cvtps_epi32(_mm256_mul_ps(x2, vid)), q3 = _mm256_cvtps_epi32(_mm256_mul_ps(x3, vid));
      /* the sums of the values the codes stand for, not of x: a weight's bias then multiplies
       * the same activations as its codes do, and the two errors, which the scales' and the
       * biases' signs mostly set against each other, cancel (x's own sum gave SmolLM2-shaped
       * products 2.5 times the error) */
      size_t row = (size_t)i * planes, b = row * blocks + kk / Q8_BLOCK;
      if (planes == 1) {
        q8_store_codes(qa + row * k + kk, q0, q1, q2, q3);
        qd[b] = d;
        qs[b] = d * (float)q8_sum(q0, q1, q2, q3);
        continue;
      }
      const __m256i half = _mm256_set1_epi32(128);
      __m256i h0 = _mm256_srai_epi32(_mm256_add_epi32(q0, half), 8), h1 = _mm256_srai_epi32(_mm256_add_epi32(q1, half), 8),
              h2 = _mm256_srai_epi32(_mm256_add_epi32(q2, half), 8), h3 = _mm256_srai_epi32(_mm256_add_epi32(q3, half), 8);
      __m256i l0 = _mm256_sub_epi32(q0, _mm256_slli_epi32(h0, 8)), l1 = _mm256_sub_epi32(q1, _mm256_slli_epi32(h1, 8)),
              l2 = _mm256_sub_epi32(q2, _mm256_slli_epi32(h2, 8)), l3 = _mm256_sub_epi32(q3, _mm256_slli_epi32(h3, 8));
      q8_store_codes(qa + row * k + kk, h0, h1, h2, h3);
      q8_store_codes(qa + (row + 1) * k + kk, l0, l1, l2, l3);
      qd[b] = 256.0f * d;
      qs[b] = 256.0f * d * (float)q8_sum(h0, h1, h2, h3);
      qd[b + blocks] = d;
      qs[b + blocks] = d * (float)q8_sum(l0, l1, l2, l3);
    }
}

/* Rows i0..i0+mr-1 of a by the 16 weight rows of block jb (outputs jb*16 .. +15). */
__attribute__((target("avx512f,avx512bw,avx512vnni"), always_inline)) static inline void
q8_tile(const product_t *p, int i0, int jb, const int mr, const int bits) {
  const struct stored_weight *s = p->stored;
  const int blocks = p->k / Q8_BLOCK;
  const size_t block_bytes = (size_t)Q8_ROWS * Q8_BLOCK * bits / 8; /* 256 or 512 */
  const uint8_t *c = s->q8 + (size_t)jb * blocks * block_bytes;
  const size_t first = (size_t)jb * blocks * Q8_ROWS; /* the block's scales and biases */
  const __m512i low4 = _mm512_set1_epi8(15);
  __m512 acc[Q8_TILE];
  for (int r = 0; r < mr; r++)
    acc[r] = _mm512_setzero_ps();
  for (int b = 0; b < blocks; b++, c += block_bytes) {
    __m512i sum[Q8_TILE];
    for (int r = 0; r < mr; r++)
      sum[r] = _mm512_setzero_si512();
    for (int l = 0; l < (int)block_bytes; l += 64) /* the block 8 ahead: 2-4 KB */
      _mm_prefetch((const char *)(c + 8 * block_bytes + l), _MM_HINT_T0);
    if (bits == 4) {
      for (int ch = 0; ch < 4; ch++) {
        __m512i v = _mm512_loadu_si512(c + 64 * ch);
        __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        for (int r = 0; r < mr; r++) {
          const int8_t *x = p->qa + (size_t)(i0 + r) * p->k + b * Q8_BLOCK;
          int32_t x_lo, x_hi;
          memcpy(&x_lo, x + 4 * ch, 4);
          memcpy(&x_hi, x + 16 + 4 * ch, 4);
          sum[r] = _mm512_dpbusd_epi32(sum[r], lo, _mm512_set1_epi32(x_lo));
          sum[r] = _mm512_dpbusd_epi32(sum[r], hi, _mm512_set1_epi32(x_hi));
        }
      }
    } else {
      for (int ch = 0; ch < 8; ch++) {
        __m512i v = _mm512_loadu_si512(c + 64 * ch);
        for (int r = 0; r < mr; r++) {
          int32_t x4;
          memcpy(&x4, p->qa + (size_t)(i0 + r) * p->k + b * Q8_BLOCK + 4 * ch, 4);
          sum[r] = _mm512_dpbusd_epi32(sum[r], v, _mm512_set1_epi32(x4));
        }
      }
    }
    __m512 scale = q8_values16(s, s->q8_scales, first + (size_t)b * Q8_ROWS),
           bias = q8_values16(s, s->q8_biases, first + (size_t)b * Q8_ROWS);
    for (int r = 0; r < mr; r++) {
      size_t at = (size_t)(i0 + r) * blocks + b;
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r]), _mm512_mul_ps(scale, _mm512_set1_ps(p->qd[at])), acc[r]);
      acc[r] = _mm512_fmadd_ps(bias, _mm512_set1_ps(p->qs[at]), acc[r]);
    }
  }
  int j = jb * Q8_ROWS, lanes = p->n - j < Q8_ROWS ? p->n - j : Q8_ROWS;
  for (int r = 0; r < mr; r += p->planes) { /* a tile holds whole rows: both planes of each */
    __m512 v = p->planes == 2 ? _mm512_add_ps(acc[r], acc[r + 1]) : acc[r];
    int i = (i0 + r) / p->planes;
    if (p->alpha == 1.0f && p->beta == 0.0f) {
      _mm512_mask_storeu_ps(p->c + (size_t)i * p->ldc + j, (__mmask16)((1u << lanes) - 1), v);
    } else {
      float out[Q8_ROWS];
      _mm512_storeu_ps(out, v);
      for (int l = 0; l < lanes; l++)
        store(p, i, j + l, out[l]);
    }
  }
}

#define Q8_TILES(BITS)                                                                                      \
  do {                                                                                                      \
    for (int jb = j0 / Q8_ROWS; jb < (j1 + Q8_ROWS - 1) / Q8_ROWS; jb++) {                                  \
      int i = 0, rows = p->m * p->planes; /* rows of codes: even with two planes, as Q8_TILE */          \
      for (; i + Q8_TILE <= rows; i += Q8_TILE)                                                             \
        q8_tile(p, i, jb, Q8_TILE, BITS);                                                                   \
      switch (rows - i) {                                                                                   \
      case 7: q8_tile(p, i, jb, 7, BITS); break;                                                            \
      case 6: q8_tile(p, i, jb, 6, BITS); break;                                                            \
      case 5: q8_tile(p, i, jb, 5, BITS); break;                                                            \
      case 4: q8_tile(p, i, jb, 4, BITS); break;                                                            \
      case 3: q8_tile(p, i, jb, 3, BITS); break;                                                            \
      case 2: q8_tile(p, i, jb, 2, BITS); break;                                                            \
      case 1: q8_tile(p, i, jb, 1, BITS); break;                                                            \
      }                                                                                                     \
    }                                                                                                       \
  } while (0)

/* q8_tile with AVX2 (no vpdpbusd): rows i0..i0+mr-1 of a by one half (8 rows) of weight block
 * jb. vpmaddubsw multiplies unsigned weight codes by signed activation codes and adds pairs in
 * 16 bits, saturating past 32,767: with codes of at most 4 bits (8-bit weights split into their
 * two nibbles) a pair is at most 2 * 15 * 127 and a block's 8 pairs of a lane at most 30,480, so
 * they add in 16 bits exactly and one vpmaddwd widens them (the high nibbles times 16). The sums
 * are the same integers as vpdpbusd's, and the rest is q8_tile's arithmetic lane by lane: the
 * outputs are the AVX-512 path's bits. */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void q8_tile_avx2(
    const product_t *p, int i0, int jb, int half, const int mr, const int bits) {
  const struct stored_weight *s = p->stored;
  const int blocks = p->k / Q8_BLOCK;
  const size_t block_bytes = (size_t)Q8_ROWS * Q8_BLOCK * bits / 8;
  const uint8_t *c = s->q8 + (size_t)jb * blocks * block_bytes + 32 * half;
  const size_t first = (size_t)jb * blocks * Q8_ROWS + 8 * half; /* its scales and biases */
  const __m256i low4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1), sixteen = _mm256_set1_epi16(16);
  __m256 acc[Q8_TILE_AVX2];
  for (int r = 0; r < mr; r++)
    acc[r] = _mm256_setzero_ps();
  for (int b = 0; b < blocks; b++, c += block_bytes) {
    __m256i lo[Q8_TILE_AVX2], hi[Q8_TILE_AVX2];
    for (int r = 0; r < mr; r++)
      lo[r] = hi[r] = _mm256_setzero_si256();
    if (half == 0)
      for (int l = 0; l < (int)block_bytes; l += 64) /* the block 8 ahead, both halves */
        _mm_prefetch((const char *)(c + 8 * block_bytes + l), _MM_HINT_T0);
    for (int ch = 0; ch < (bits == 4 ? 4 : 8); ch++) {
      __m256i v = _mm256_loadu_si256((const __m256i *)(c + 64 * ch));
      __m256i vl = _mm256_and_si256(v, low4), vh = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      for (int r = 0; r < mr; r++) {
        const int8_t *x = p->qa + (size_t)(i0 + r) * p->k + b * Q8_BLOCK;
        int32_t xl, xh;
        if (bits == 4) { /* low nibbles: elements 4ch..+3, high: 16 + 4ch..+3 */
          memcpy(&xl, x + 4 * ch, 4);
          memcpy(&xh, x + 16 + 4 * ch, 4);
        } else { /* both nibbles of elements 4ch..+3 */
          memcpy(&xl, x + 4 * ch, 4);
          xh = xl;
        }
        lo[r] = _mm256_add_epi16(lo[r], _mm256_maddubs_epi16(vl, _mm256_set1_epi32(xl)));
        hi[r] = _mm256_add_epi16(hi[r], _mm256_maddubs_epi16(vh, _mm256_set1_epi32(xh)));
      }
    }
    __m256 scale = q8_values8(s, s->q8_scales, first + (size_t)b * Q8_ROWS),
           bias = q8_values8(s, s->q8_biases, first + (size_t)b * Q8_ROWS);
    for (int r = 0; r < mr; r++) {
      __m256i sum = bits == 4 ? _mm256_madd_epi16(_mm256_add_epi16(lo[r], hi[r]), ones)
                              : _mm256_add_epi32(_mm256_madd_epi16(lo[r], ones), _mm256_madd_epi16(hi[r], sixteen));
      size_t at = (size_t)(i0 + r) * blocks + b;
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(scale, _mm256_set1_ps(p->qd[at])), acc[r]);
      acc[r] = _mm256_fmadd_ps(bias, _mm256_set1_ps(p->qs[at]), acc[r]);
    }
  }
  int j = jb * Q8_ROWS + 8 * half, lanes = p->n - j < 8 ? p->n - j : 8;
  for (int r = 0; r < mr; r += p->planes) { /* a tile holds whole rows: both planes of each */
    float out[8];
    int i = (i0 + r) / p->planes;
    _mm256_storeu_ps(out, p->planes == 2 ? _mm256_add_ps(acc[r], acc[r + 1]) : acc[r]);
    if (p->alpha == 1.0f && p->beta == 0.0f && lanes == 8)
      memcpy(p->c + (size_t)i * p->ldc + j, out, sizeof out);
    else
      for (int l = 0; l < lanes; l++)
        store(p, i, j + l, out[l]);
  }
}

#define Q8_TILES_AVX2(BITS)                                                                                 \
  do {                                                                                                      \
    for (int jb = j0 / Q8_ROWS; jb < (j1 + Q8_ROWS - 1) / Q8_ROWS; jb++)                                    \
      for (int half = 0; half < 2 && jb * Q8_ROWS + 8 * half < p->n; half++) {                              \
        int i = 0, rows = p->m * p->planes; /* even with two planes, as Q8_TILE_AVX2 */                    \
        for (; i + Q8_TILE_AVX2 <= rows; i += Q8_TILE_AVX2)                                                 \
          q8_tile_avx2(p, i, jb, half, Q8_TILE_AVX2, BITS);                                                 \
        switch (rows - i) {                                                                                 \
        case 3: q8_tile_avx2(p, i, jb, half, 3, BITS); break;                                               \
        case 2: q8_tile_avx2(p, i, jb, half, 2, BITS); break;                                               \
        case 1: q8_tile_avx2(p, i, jb, half, 1, BITS); break;                                               \
        }                                                                                                   \
      }                                                                                                     \
  } while (0)

__attribute__((target("avx2,fma,f16c"))) static void q8_columns_avx2(const product_t *p, int j0, int j1) {
  if (p->stored->bits == 4)
    Q8_TILES_AVX2(4);
  else
    Q8_TILES_AVX2(8);
}

/* Output columns [j0, j1) (j0 a multiple of 16: the pool's items are 64 columns). */
__attribute__((target("avx512f,avx512bw,avx512vnni"))) static void q8_columns_vnni(const product_t *p, int j0,
                                                                                     int j1) {
  if (p->stored->bits == 4)
    Q8_TILES(4);
  else
    Q8_TILES(8);
}

static void q8_columns(const product_t *p, int j0, int j1) {
  (q8_vnni ? q8_columns_vnni : q8_columns_avx2)(p, j0, j1);
}

/* Builds s's 8-bit-activation layout (see above); leaves it NULL without the memory. */
static void q8_pack(struct stored_weight *s) {
  int blocks = s->k / Q8_BLOCK, jbs = (s->n + Q8_ROWS - 1) / Q8_ROWS;
  size_t block_bytes = (size_t)Q8_ROWS * Q8_BLOCK * s->bits / 8;
  uint8_t *q8 = calloc((size_t)jbs * blocks, block_bytes);
  size_t width = held_width(s);
  char *sc = calloc((size_t)jbs * blocks * Q8_ROWS, width);
  char *bi = calloc((size_t)jbs * blocks * Q8_ROWS, width);
  if (!q8 || !sc || !bi) {
    free(q8), free(sc), free(bi);
    return;
  }
  for (int j = 0; j < s->n; j++) {
    const uint8_t *row = s->q + (size_t)j * s->row_bytes;
    int jb = j / Q8_ROWS, r = j % Q8_ROWS;
    for (int b = 0; b < blocks; b++) {
      size_t at = (size_t)jb * blocks + b;
      size_t g = ((size_t)j * s->k + (size_t)b * Q8_BLOCK) >> s->group_shift;
      size_t to = (at * Q8_ROWS + r) * width;
      memcpy(sc + to, s->scales16 ? (const void *)(s->scales16 + g) : (const void *)(s->scales + g), width);
      memcpy(bi + to, s->biases16 ? (const void *)(s->biases16 + g) : (const void *)(s->biases + g), width);
      /* Row r's 4 bytes in each chunk: byte 4c + e of chunk c holds element 4c + e (8-bit), or
       * 4c + e in its low nibble and 16 + 4c + e in its high one (4-bit; MLX's bytes hold
       * elements 2u and 2u + 1, low nibble first). Whole bytes at a time: element by element
       * this took about half a second of SmolLM2's load. */
      const uint8_t *src = row + (size_t)b * Q8_BLOCK * s->bits / 8;
      uint8_t *dst = q8 + at * block_bytes + 4 * r, v[16];
      if (s->bits == 8) {
        for (int c = 0; c < 8; c++)
          memcpy(dst + 64 * c, src + 4 * c, 4);
        continue;
      }
      for (int u = 0; u < 8; u++) { /* v[t]: element t low, element t + 16 high */
        v[2 * u] = (uint8_t)((src[u] & 15) | (src[u + 8] << 4));
        v[2 * u + 1] = (uint8_t)((src[u] >> 4) | (src[u + 8] & 0xF0));
      }
      for (int c = 0; c < 4; c++)
        memcpy(dst + 64 * c, v + 4 * c, 4);
    }
  }
  s->q8 = q8, s->q8_scales = sc, s->q8_biases = bi;
}

/* Each thread's buffers of quantized rows. */
static __thread int8_t *q8_codes_buf;
static __thread float *q8_scale_buf;
static __thread size_t q8_cap, q8_block_cap;

/* A product of any rows by a weight with the 8-bit-activation layout: a's rows quantized by
 * the calling thread, then split between the threads by output columns as every product.
 * Returns 0 (nothing done) without the memory for the quantized rows. */
static void skinny_product(const product_t *p);
static int q8_product(product_t *p, int planes) {
  size_t codes = (size_t)p->m * planes * p->k, blocks = codes / Q8_BLOCK;
  if (codes > q8_cap) {
    free(q8_codes_buf);
    q8_codes_buf = malloc(codes);
    q8_cap = q8_codes_buf ? codes : 0;
  }
  if (blocks > q8_block_cap) {
    free(q8_scale_buf);
    q8_scale_buf = malloc(2 * blocks * sizeof(float));
    q8_block_cap = q8_scale_buf ? blocks : 0;
  }
  if (codes > q8_cap || blocks > q8_block_cap)
    return 0;
  q8_quantize(p->a, p->m, p->lda, p->k, planes, q8_codes_buf, q8_scale_buf, q8_scale_buf + blocks);
  p->qa = q8_codes_buf, p->qd = q8_scale_buf, p->qs = q8_scale_buf + blocks, p->planes = planes;
  atomic_fetch_add_explicit(&q8_served, 1, memory_order_relaxed);
  skinny_product(p);
  return 1;
}

/* Output columns [j0, j1) of a product whose weight is read stored: NR weight rows of a depth
 * block at a time are expanded into a buffer in the L1 cache and multiplied there by the
 * float32 kernel's own tiles, in product_columns's depth blocks, so every output is the same
 * sum of the same values as when the float32 weight is read. */
static void stored_columns(const product_t *p, int j0, int j1) {
  const struct stored_weight *s = p->stored;
  int block = k_block > 0 && p->k > k_block + k_block / 2 ? k_block : p->k;
  void (*many)(const product_t *, int) = use_avx512 ? rows4_avx512 : rows4_avx2;
  void (*one)(const product_t *, int) = use_avx512 ? rows1_avx512 : rows1_avx2;
  /* The register loops below take 32 columns a step, so they serve depth blocks
   * (SPECSTREAM_SKINNY_KBLOCK: whole vectors of 16) of whole steps only; otherwise one row reads
   * the codes in MLX's order and several rows go through the buffer, both 16 columns at a time. */
  int whole_steps = block == p->k || block % 32 == 0;
  int packed = whole_steps && s->packed != NULL;
  int fused = use_avx512 && whole_steps && p->m <= fused_rows && (s->packed != NULL || s->bits == 8);
  if (p->m == 1 || fused) { /* in registers, no buffer */
    void (*row)(const product_t *, int, int, int, int) = use_avx512 ? srows_avx512 : srows_avx2;
    if (p->m > 1)
      row = stiles_avx512;
    else if (packed)
      row = srows4_packed_avx512;
    for (int k0 = 0; k0 < p->k; k0 += block) {
      product_t q = *p;
      if (k0 > 0)
        q.beta = 1.0f;
      row(&q, j0, j1, k0, p->k - k0 < block ? p->k : k0 + block);
    }
    return;
  }
  float *buf = strip((size_t)NR * block);
  if (buf == NULL) { /* out of memory: the float32 weight, as stored in b */
    product_t q = *p;
    q.stored = NULL;
    product_columns(&q, j0, j1);
    return;
  }
  for (int k0 = 0; k0 < p->k; k0 += block) {
    int k1 = p->k - k0 < block ? p->k : k0 + block;
    product_t q = *p;
    q.a = p->a + k0;
    q.k = k1 - k0;
    q.ldb = k1 - k0;
    q.b = buf;
    if (k0 > 0)
      q.beta = 1.0f; /* the blocks before it are in c */
    for (int j = j0; j < j1;) {
      int nr = j1 - j >= NR ? NR : 1;
      for (int r = 0; r < nr; r++)
        expand(s, j + r, k0, k1, buf + (size_t)r * q.ldb);
      q.c = p->c + j; /* the tiles write columns 0..nr-1 of this view */
      (nr == NR ? many : one)(&q, 0);
      j += nr;
    }
  }
}

/* Output columns [j0, j1) for every row of a. */
static void product_columns(const product_t *p, int j0, int j1) {
  if (p->qa) {
    q8_columns(p, j0, j1);
    return;
  }
  if (p->stored) {
    stored_columns(p, j0, j1);
    return;
  }
  if (p->trans_b && k_block > 0 && p->k > k_block + k_block / 2) {
    /* Every block in the row tiles, a short last one too, whatever the rows: a row's output is
     * then the same bits in a product of any number of rows. */
    for (int k0 = 0; k0 < p->k; k0 += k_block) {
      product_t q = *p;
      q.k = p->k - k0 < k_block ? p->k - k0 : k_block;
      q.a = p->a + k0;
      q.b = p->b + k0;
      if (k0 > 0)
        q.beta = 1.0f; /* the blocks before it are in c */
      row_columns(&q, j0, j1);
    }
    return;
  }
  int j = j0;
  if (p->trans_b) {
    row_columns(p, j, j1);
    return;
  }
  if (use_avx512)
    j = kn_columns_avx512(p, j, j1);
  for (; j + 32 <= j1; j += 32)
    kn4_avx2(p, j);
  for (; j + 8 <= j1; j += 8)
    kn1_avx2(p, j);
  for (; j < j1; j++) /* the last columns, one at a time */
    for (int i = 0; i < p->m; i++) {
      float v = 0.0f;
      for (int kk = 0; kk < p->k; kk++)
        v += p->a[(size_t)i * p->lda + kk] * p->b[(size_t)kk * p->ldb + j];
      store(p, i, j, v);
    }
}

/* ---- the thread pool ---------------------------------------------------------------- */

static struct {
  pthread_mutex_t lock; /* one product at a time; a second caller computes alone */
  int threads;
  const product_t *job;
  atomic_int generation; /* bumped for every product; workers wait on it */
  _Atomic unsigned long long claims; /* work items handed out: from the front (low half, the
                                       * workers) and from the back (high half, the caller) */
  atomic_int gate;       /* workers that joined the current product; CLOSED once the caller is done */
  atomic_int finished;   /* joined workers that are done with it */
  atomic_int sleepers;   /* workers in (or about to enter) a futex wait */
  int items;
  /* The weight a worker reads ahead between products (see ahead_bytes): up to AHEAD_RANGES
   * ranges of bytes (a weight read stored: its codes, scales and biases). */
  _Atomic(const char *) ahead_ptr[3];
  atomic_size_t ahead_len[3];
  atomic_int ahead_gen;
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER};

/* The caller never waits for a worker that has not started: on a loaded machine a woken
 * worker may get no core for milliseconds, while the caller takes every item itself. */
enum { CLOSED = 1 << 20 };

static long futex(atomic_int *addr, int op, int val) { return syscall(SYS_futex, addr, op, val, NULL, NULL, 0); }

static double now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e6 + t.tv_nsec * 1e-3;
}

/* Items are taken from both ends: the workers from the front, where the weight read ahead
 * is (read_ahead), the caller from the back. A claim is valid while the items taken from both
 * ends, before it, are fewer than the product's; a front and a back claim never meet on one
 * item, since whichever came second saw the other counted. */
static void run_items(const product_t *p, int from_back) {
  const unsigned long long one = from_back ? 1ull << 32 : 1ull;
  for (;;) {
    unsigned long long c = atomic_fetch_add(&pool.claims, one);
    unsigned front = (unsigned)c, back = (unsigned)(c >> 32);
    if ((long)front + back >= pool.items)
      return;
    int it = from_back ? pool.items - 1 - (int)back : (int)front;
    int j0 = it * ITEM_ROWS, j1 = j0 + ITEM_ROWS < p->n ? j0 + ITEM_ROWS : p->n;
    product_columns(p, j0, j1);
  }
}

/* Reading ahead: between products the memory bus idles while the caller runs the
 * element-wise work between them (norms, attention, residuals: ~3 ms of a SmolLM2 step on
 * an Intel Xeon, in ~120 gaps). The products of a step come in the same order step after
 * step, so the weight that followed this one last time is the likely next: a waiting worker
 * prefetches its first rows into its own L2 cache, and computes them first when the product
 * comes (workers take items from the front). Measured on an Intel Xeon (Emerald Rapids, 2 MB
 * of L2 a core), in one process, setting by setting in turn (examples/lock_spin_ab.py
 * --setting ahead, six runs): ~47 MB of a SmolLM2 step read ahead, the plain step 0.965-0.987x
 * as long with 1024 KB, 0.988 with 2048, 1.00 with 256; a 9-node pass 0.98-1.02x (its noise).
 * Publishing the next weight when a product starts (the worker reads ahead as soon as its share
 * is done) was slower (1.036x), and spinning anew after a read-ahead no better (0.987x and
 * 1.014x in two runs). The caller taking the read-ahead rows too (from the front) was slower
 * (1.04x): another core's L2 served them slower than memory. A weight read as stored is read
 * ahead as stored (its codes, scales and biases, which are what stream): on an AMD EPYC (Zen 4,
 * 2 cores) SmolLM2's plain step with its 4-bit weights read stored 0.966-0.971x as long with
 * 1024 KB as with none, a 9-node pass 0.973-0.990x (two runs of 8-12 rounds); its float32
 * reading there 0.979x, the pass 1.01x. SPECSTREAM_SKINNY_AHEAD_KB: how much (default 1024);
 * only while the weights stream from memory (a cached model's are at hand anyway), at most
 * half of the next weight (the workers' share). */
static atomic_size_t ahead_bytes; /* set by setup() and specstream_skinny_set_ahead_kb */
static atomic_llong ahead_done; /* bytes read ahead, all told (specstream_skinny_ahead_read) */
enum { NEXT_SLOTS = 1024, NEXT_BITS = 10 };
/* Which weight followed which, written under seen_lock (note_weight); read without it: a
 * torn or stale entry only prefetches the wrong bytes, and a prefetch never faults. */
static struct {
  const float *key, *next;
  int next_n, next_k, next_ldb; /* the next weight's shape: what its stored form is found by */
} next_of[NEXT_SLOTS];
static const float *last_weight;

/* A table slot of a weight's pointer: the top `bits` bits of its cache line's number,
 * Fibonacci-hashed. */
static size_t pointer_slot(const float *b, int bits) { return ((size_t)b >> 6) * 0x9E3779B97F4A7C15ull >> (64 - bits); }

/* Prefetches the published ranges into L2, a page at a time, until done or a product starts
 * (generation moves from seen). */
static void read_ahead(int *seen_ahead, int seen) {
  int ag = atomic_load(&pool.ahead_gen);
  if (ag == *seen_ahead)
    return;
  *seen_ahead = ag;
  for (int r = 0; r < 3; r++) {
    const char *ptr = atomic_load(&pool.ahead_ptr[r]);
    size_t len = atomic_load(&pool.ahead_len[r]), off = 0;
    for (; off < len && atomic_load_explicit(&pool.generation, memory_order_relaxed) == seen; off += 4096) {
      size_t end = off + 4096 < len ? off + 4096 : len;
      for (size_t o = off; o < end; o += 64)
        _mm_prefetch(ptr + o, _MM_HINT_T1);
    }
    atomic_fetch_add_explicit(&ahead_done, (long long)(off < len ? off : len), memory_order_relaxed);
    if (off < len)
      return;
  }
}

/* Whether a waiting worker yields its core at every turn of its spin
 * (SPECSTREAM_SKINNY_YIELD; 0: it pauses instead). */
static int spin_yield = 1;

static void *worker(void *arg) {
  const int reads_ahead = (long)arg == 1; /* one worker reads ahead: one L2 holds it */
  int seen = 0, seen_ahead = 0;
  for (;;) {
    /* Spin briefly for the next product (a decoding step issues them back to back,
     * some tens of microseconds apart), then sleep until woken: a longer spin takes
     * the core from the thread that builds the next step. And while it spins the core
     * goes to that thread whenever it is ready: with two cores the worker shares its
     * core with MLX's graph-building thread, which MLX wakes every ten operations, and
     * a pausing worker kept it waiting (a SmolLM2 step 4% faster yielding,
     * examples/skinny_ab.sh, docs/DESIGN.md decision 15). */
    double t0 = now_us();
    int g;
    while ((g = atomic_load(&pool.generation)) == seen) {
      if (reads_ahead && atomic_load_explicit(&ahead_bytes, memory_order_relaxed) > 0)
        read_ahead(&seen_ahead, seen);
      if (spin_yield)
        sched_yield();
      else
        for (int s = 0; s < 16; s++)
          _mm_pause();
      if (now_us() - t0 > spin_us) {
        /* Counted before the wait: a caller that bumps the generation after this either
         * sees the count and wakes us, or bumped it first and the wait returns at once. */
        atomic_fetch_add(&pool.sleepers, 1);
        futex(&pool.generation, FUTEX_WAIT_PRIVATE, seen);
        atomic_fetch_sub(&pool.sleepers, 1);
        t0 = now_us();
      }
    }
    seen = g;
    if (atomic_fetch_add(&pool.gate, 1) & CLOSED)
      continue; /* the caller finished this product alone */
    run_items(pool.job, 0);
    atomic_fetch_add(&pool.finished, 1);
  }
  return NULL;
}

static int skinny_rows = -1; /* -1: settings not read yet */
static int skinny_min_rows = 1; /* SPECSTREAM_SKINNY_MIN_ROWS=2: one row to the library's GEMV */
static long parallel_min = PARALLEL_MIN_WEIGHTS; /* SPECSTREAM_SKINNY_PARALLEL_MIN (both regimes) */
static long parallel_min_streaming = PARALLEL_MIN_STREAMING;

/* Whether the weights stream from memory: the distinct weights (by pointer, those of 64K
 * elements or more) of the last SEEN_WINDOW such products add up to more than the
 * last-level cache. A window, not the whole run: a long-lived process allocates new KV
 * buffers (attention's products read them) request after request, and a small model must
 * not be taken for a large one by what it has freed. Counted under a lock of its own (a
 * product that finds it taken is not counted). */
enum { SEEN_SLOTS = 4096, SEEN_MIN_WEIGHTS = 64 * 1024, SEEN_WINDOW = 4096 };
static struct {
  const float *key;
  size_t bytes;
} seen_weights[SEEN_SLOTS];
static size_t seen_bytes, cache_bytes;
static int seen_products;
static atomic_int streaming;
static pthread_mutex_t seen_lock = PTHREAD_MUTEX_INITIALIZER;

static void note_weight(const product_t *p) {
  if ((long)p->n * p->k < SEEN_MIN_WEIGHTS || pthread_mutex_trylock(&seen_lock) != 0)
    return;
  if (p->trans_b && last_weight != p->b) { /* this weight follows the last one */
    size_t t = pointer_slot(last_weight, NEXT_BITS);
    next_of[t].key = last_weight;
    next_of[t].next = p->b;
    next_of[t].next_n = p->n;
    next_of[t].next_k = p->k;
    next_of[t].next_ldb = p->ldb;
    last_weight = p->b;
  }
  size_t s = pointer_slot(p->b, 12); /* SEEN_SLOTS */
  if (seen_weights[s].key != p->b) {
    size_t bytes = (size_t)(p->trans_b ? p->n : p->k) * p->ldb * sizeof(float);
    seen_bytes += bytes - seen_weights[s].bytes;
    seen_weights[s].key = p->b;
    seen_weights[s].bytes = bytes;
    if (seen_bytes > cache_bytes)
      atomic_store(&streaming, 1);
  }
  if (++seen_products == SEEN_WINDOW) { /* the window's verdict; the next one starts empty */
    atomic_store(&streaming, seen_bytes > cache_bytes);
    memset(seen_weights, 0, sizeof(seen_weights));
    seen_bytes = 0;
    seen_products = 0;
  }
  pthread_mutex_unlock(&seen_lock);
}

/* A forked child has none of the workers: it computes alone (its products are correct,
 * just not parallel), and a lock held at the fork is not held in it. */
static void child_after_fork(void) {
  pool.threads = 1;
  pthread_mutex_init(&pool.lock, NULL);
  pthread_mutex_init(&seen_lock, NULL);
}

/* Bytes of the last-level cache the first CPU shares, as the kernel reports it (sysfs):
 * glibc's sysconf reads the CPU's own report, which on a virtual machine can be the whole
 * host processor's (384 MiB for this EPYC's 32 MiB). 32 MiB when nothing says. */
static size_t last_level_cache(void) {
  size_t best = 0;
  for (int i = 0; i < 8; i++) {
    char path[96], text[32];
    snprintf(path, sizeof(path), "/sys/devices/system/cpu/cpu0/cache/index%d/size", i);
    FILE *f = fopen(path, "r");
    if (!f)
      break;
    size_t size = 0;
    if (fgets(text, sizeof(text), f)) {
      char *end;
      size = strtoul(text, &end, 10);
      size <<= *end == 'K' ? 10 : *end == 'M' ? 20 : 0;
    }
    fclose(f);
    if (size > best)
      best = size;
  }
  if (best > 0)
    return best;
  long conf = sysconf(_SC_LEVEL3_CACHE_SIZE);
  return conf > 0 ? (size_t)conf : 32u << 20;
}

static void setup(void) {
  __builtin_cpu_init(); /* the first product may come from another library's constructor */
  pthread_atfork(NULL, NULL, child_after_fork);
  const char *rows = getenv("SPECSTREAM_SKINNY_ROWS");
  const char *isa = getenv("SPECSTREAM_SKINNY_ISA");
  use_avx512 = __builtin_cpu_supports("avx512f") && !(isa && strcmp(isa, "avx2") == 0);
  q8_vnni = use_avx512 && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
  q8_capable = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const char *products = getenv("SPECSTREAM_PRODUCTS");
  /* 16-bit activations unless asked otherwise: within float32's own rounding noise of the
   * float32 products in SmolLM2's next-token distributions, and faster (see above) */
  q8_wanted = products && strcmp(products, "exact") == 0 ? 0 : products && strcmp(products, "q8") == 0 ? 1 : 2;
  atomic_store(&q8_on, q8_capable ? q8_wanted : 0);
  /* Where the kernel beats the library's GEMM on SmolLM2's shapes: up to 48 rows with
   * AVX-512 (56.9 against 78.1 ms at 48), up to 32 with AVX2 (60.1 against 63.1). */
  int want_rows = rows ? atoi(rows) : use_avx512 ? SKINNY_MAX_ROWS : 32;
  if (want_rows < 2) /* one row is never the kernel's: 0 and 1 both mean off */
    want_rows = 0;
  if (want_rows > SKINNY_MAX_ROWS)
    want_rows = SKINNY_MAX_ROWS;
  if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")))
    want_rows = 0;
  const char *mn = getenv("SPECSTREAM_SKINNY_MIN_ROWS");
  if (mn && atoi(mn) >= 1)
    skinny_min_rows = atoi(mn) > 2 ? 2 : atoi(mn);
  const char *pm = getenv("SPECSTREAM_SKINNY_PARALLEL_MIN");
  if (pm && atol(pm) >= 0)
    parallel_min = parallel_min_streaming = atol(pm);
  cache_bytes = last_level_cache();
  const char *pf = getenv("SPECSTREAM_SKINNY_PREFETCH");
  if (pf && strcmp(pf, "nta") == 0)
    prefetch_mode = PREFETCH_NTA;
  else if (pf && strcmp(pf, "t0") == 0)
    prefetch_mode = PREFETCH_T0;
  else if (pf && strcmp(pf, "t1") == 0)
    prefetch_mode = PREFETCH_T1;
  else if (pf && strcmp(pf, "off") == 0)
    prefetch_mode = PREFETCH_OFF;
  const char *fr = getenv("SPECSTREAM_SKINNY_FUSED_ROWS");
  if (fr && atoi(fr) >= 1 && atoi(fr) <= FUSED_ROWS)
    fused_rows = atoi(fr);
  const char *kb = getenv("SPECSTREAM_SKINNY_KBLOCK");
  if (kb && *kb && atoi(kb) >= 0)
    k_block = atoi(kb) >= 16 ? atoi(kb) / 16 * 16 : 0; /* whole vectors; below one: none */
  atomic_store(&ahead_bytes, 1024 << 10);
  const char *ah = getenv("SPECSTREAM_SKINNY_AHEAD_KB");
  if (ah && *ah && atol(ah) >= 0)
    atomic_store(&ahead_bytes, (size_t)atol(ah) << 10);
  const char *sp = getenv("SPECSTREAM_SKINNY_SPIN_US");
  if (sp && atof(sp) >= 0)
    spin_us = atof(sp);
  const char *sy = getenv("SPECSTREAM_SKINNY_YIELD");
  if (sy && *sy)
    spin_yield = atoi(sy) != 0;
  const char *th = getenv("SPECSTREAM_SKINNY_THREADS");
  long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  int threads = th ? atoi(th) : (int)(cpus > 0 ? cpus : 1);
  if (threads < 1)
    threads = 1;
  if (threads > MAX_THREADS)
    threads = MAX_THREADS;
  pool.threads = 1;
  for (int t = 1; t < threads && want_rows > 0; t++) {
    pthread_t id;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&id, &attr, worker, (void *)(long)t) == 0)
      pool.threads++;
    pthread_attr_destroy(&attr);
  }
  skinny_rows = want_rows;
}

static pthread_once_t setup_once = PTHREAD_ONCE_INIT;

/* After a product of a weight: publishes the weight that followed it last time for a
 * waiting worker to read ahead (read_ahead): the bytes of its first rows (the workers'), at
 * most half of them, in float32 or, where a product of as many rows reads it stored, its
 * codes, scales and biases of those rows. */
static void publish_next(const product_t *p) {
  size_t most = atomic_load_explicit(&ahead_bytes, memory_order_relaxed);
  if (most == 0 || !p->trans_b || !atomic_load_explicit(&streaming, memory_order_relaxed))
    return;
  size_t t = pointer_slot(p->b, NEXT_BITS);
  const float *next = next_of[t].next;
  if (next_of[t].key != p->b || !next)
    return;
  int n = next_of[t].next_n, k = next_of[t].next_k;
  const struct stored_weight *found = find_stored(next, n, k, next_of[t].next_ldb);
  const struct stored_weight *s = stored_for(found, p->m);
  const char *ptr[3] = {(const char *)next, NULL, NULL};
  size_t row[3] = {(size_t)next_of[t].next_ldb * sizeof(float), 0, 0};
  if (q8_reads(found)) { /* read by 8-bit activations: its layout for them */
    s = NULL;
    ptr[0] = (const char *)found->q8;
    row[0] = found->row_bytes;
    ptr[1] = (const char *)found->q8_scales;
    ptr[2] = (const char *)found->q8_biases;
    row[1] = row[2] = (size_t)k / Q8_BLOCK * held_width(found);
  }
  if (s) {
    size_t groups = (size_t)k >> s->group_shift;
    int in_registers = p->m == 1 || (use_avx512 && p->m <= fused_rows); /* stored_columns */
    ptr[0] = (const char *)(s->packed && in_registers ? s->packed : s->q);
    row[0] = s->row_bytes;
    ptr[1] = s->scales16 ? (const char *)s->scales16 : (const char *)s->scales;
    ptr[2] = s->biases16 ? (const char *)s->biases16 : (const char *)s->biases;
    row[1] = row[2] = groups * held_width(s);
  }
  size_t per_row = row[0] + row[1] + row[2], rows = (size_t)n / 2;
  if (rows * per_row > most)
    rows = most / per_row;
  for (int r = 0; r < 3; r++) {
    atomic_store(&pool.ahead_ptr[r], ptr[r]);
    atomic_store(&pool.ahead_len[r], rows * row[r]);
  }
  atomic_fetch_add(&pool.ahead_gen, 1);
}

static void skinny_product(const product_t *p) {
  int items = (p->n + ITEM_ROWS - 1) / ITEM_ROWS;
  note_weight(p);
  long least = atomic_load_explicit(&streaming, memory_order_relaxed) ? parallel_min_streaming : parallel_min;
  if (p->trans_b ? p->k <= KN_MAX_K : p->n <= KN_MAX_K) {
    long thin_min = atomic_load_explicit(&thin_parallel_min, memory_order_relaxed);
    least = thin_min < least ? thin_min : least;
  }
  int small = (long)p->n * p->k * (p->m > 1 ? 2 : 1) < least && (long)p->m * p->n * p->k < PARALLEL_MIN_WORK;
  if (pool.threads == 1 || items < 2 || small || pthread_mutex_trylock(&pool.lock) != 0) {
    product_columns(p, 0, p->n);
    publish_next(p);
    return;
  }
  pool.job = p;
  pool.items = items;
  atomic_store(&pool.claims, 0);
  atomic_store(&pool.finished, 0);
  atomic_store(&pool.gate, 0); /* opens the product (after job, items and counters are set) */
  atomic_fetch_add(&pool.generation, 1);
  if (atomic_load(&pool.sleepers) > 0) /* spinning workers see the generation; no system call */
    futex(&pool.generation, FUTEX_WAKE_PRIVATE, pool.threads - 1);
  run_items(p, 1);
  int joined = atomic_fetch_or(&pool.gate, CLOSED) & (CLOSED - 1);
  while (atomic_load(&pool.finished) < joined) /* only workers busy with an item remain */
    _mm_pause();
  pthread_mutex_unlock(&pool.lock);
  publish_next(p);
}
#endif /* HAVE_X86 */

/* The most rows the kernel takes (0: off), settings read on first use. */
static int kernel_rows(void) {
#if HAVE_X86
  pthread_once(&setup_once, setup);
  return skinny_rows;
#else
  return 0;
#endif
}

#if HAVE_X86
/* Whether every code (below 2^bits) times every scale is exact in float32: each scale's
 * significand has its low `bits` bits clear (normal or not), so the product needs at most 24
 * significant bits. Then q * scale + bias rounds once either way, and the expansion takes one
 * multiply-add instead of a multiply and an add: a scale stored as float16 (a GGUF file's)
 * has 11 significant bits. One row by a 3,072 x 576 weight took 60 against 65 us at four
 * bits and 85 against 92 at eight (the fastest of 48, alternating). Registration checks the
 * values all the same. */
static int exact_products(const float *scales, size_t count, int bits) {
  uint32_t low = 0;
  for (size_t i = 0; i < count; i++) {
    uint32_t u;
    memcpy(&u, scales + i, sizeof u);
    low |= u;
  }
  return (low & ((1u << bits) - 1)) == 0;
}

/* Float16 copies of count values, or NULL where one of them is not exactly a float16 (or the
 * CPU has no F16C, or no memory). */
__attribute__((target("f16c"))) static uint16_t *exact_halves(const float *v, size_t count) {
  if (!__builtin_cpu_supports("f16c"))
    return NULL;
  /* 16 more, zeros: a loop may widen 16 values from any index (srow4_packed_avx512) */
  uint16_t *h = calloc(count + 16, sizeof(uint16_t));
  for (size_t i = 0; h != NULL && i < count; i++) {
    h[i] = _cvtss_sh(v[i], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    float back = _cvtsh_ss(h[i]);
    if (memcmp(&back, v + i, sizeof back) != 0) { /* bit for bit: -0.0 stays -0.0 */
      free(h);
      h = NULL;
    }
  }
  return h;
}

static void stored_free(struct stored_weight *e) {
  free(e->scales16);
  free(e->biases16);
  free(e->q8);
  free(e->q8_scales);
  free(e->q8_biases);
  free(e->packed);
  free(e);
}

/* Repacks a four-bit form's codes for the loops that expand them in registers
 * (srow4_packed_avx512, stile_avx512: AVX-512; groups of 32 or more, so each run of 32
 * elements takes one table), if their values equal the float32 weight's, compared through
 * row (k floats of scratch). Without the memory or the match, e keeps no repacked codes: one
 * row reads MLX's order, several rows go through the buffer. */
static void pack(struct stored_weight *e, float *row) {
  if (!use_avx512 || e->bits != 4)
    return;
  uint8_t *packed = malloc((size_t)e->n * e->row_bytes);
  if (packed == NULL)
    return;
  for (int j = 0; j < e->n; j++) {
    const uint8_t *q = e->q + (size_t)j * e->row_bytes;
    uint8_t *out = packed + (size_t)j * e->row_bytes;
    for (int kk = 0; kk < e->k; kk += 32)
      for (int i = 0; i < 16; i++) {
        int lo = kk + i, hi = kk + 16 + i; /* elements; element x is nibble x % 2 of byte x / 2 */
        out[kk / 2 + i] = (uint8_t)(((q[lo / 2] >> 4 * (lo % 2)) & 15) | ((q[hi / 2] >> 4 * (hi % 2)) & 15) << 4);
      }
  }
  e->packed = packed;
  int same = 1;
  for (int j = 0; j < e->n && same; j++) {
    expand_packed_avx512(e, j, row);
    same = memcmp(row, e->w + (size_t)j * e->k, (size_t)e->k * sizeof(float)) == 0;
  }
  if (!same) {
    e->packed = NULL;
    free(packed);
  }
}

/* Registers the stored form of the float32 weight w (n x k, row-major): bits 4 or 8 per
 * element, packed the low bits first, row by row (row_bytes = k * bits / 8), and one scale and
 * one bias per group of elements of a row. The registrant keeps w, q, scales and biases alive
 * and unchanged until it unregisters w. Returns 1 when registered; 0 when the kernel does not
 * serve such a product (the kernel off, a width or group it does not take, a depth the float32
 * kernel multiplies another way), or when an expanded value differs from w's (w then stays
 * read as it is); -1 when the table is full or out of memory. */
int specstream_stored_register(const float *w, int n, int k, const void *q, int bits, int group,
                               const float *scales, const float *biases) {
  if (kernel_rows() <= 0 || (bits != 4 && bits != 8) || group < 32 || (group & (group - 1)) != 0 ||
      k % group != 0 || k <= KN_MAX_K || n < 1)
    return 0;
  struct stored_weight *e = malloc(sizeof(*e));
  if (e == NULL)
    return -1;
  size_t groups = (size_t)n * (k / group);
  *e = (struct stored_weight){w, n, k, bits, group, q, (size_t)k * bits / 8, scales, biases, NULL, NULL,
                              __builtin_ctz(group), NULL, exact_products(scales, groups, bits), INT_MAX};
  if (stored_half) { /* both or neither: every read takes them from the same width */
    e->scales16 = exact_halves(scales, groups);
    e->biases16 = e->scales16 ? exact_halves(biases, groups) : NULL;
    if (e->biases16 == NULL) {
      free(e->scales16);
      e->scales16 = NULL;
    }
  }
  /* Every row expanded as the kernel expands it must give w's row, bit for bit. */
  float *row = malloc((size_t)k * sizeof(float));
  int same = row != NULL;
  for (int j = 0; j < n && same; j++) {
    expand(e, j, 0, k, row);
    same = memcmp(row, w + (size_t)j * k, (size_t)k * sizeof(float)) == 0;
  }
  if (same) {
    pack(e, row);
    if (q8_capable && q8_wanted)
      q8_pack(e);
  }
  free(row);
  if (!same) {
    stored_free(e);
    return 0;
  }
  pthread_mutex_lock(&stored_lock);
  size_t h = stored_slot(w);
  int placed = 0, free_at = -1;
  for (int i = 0; i < STORED_SLOTS && !placed; i++) {
    size_t at = (h + i) % STORED_SLOTS;
    struct stored_weight *old = atomic_load(&stored_table[at]);
    if (old == NULL)
      break; /* the end of w's chain: w is not registered */
    if (old == &stored_gone) {
      if (free_at < 0)
        free_at = (int)at;
    } else if (old->w == w) { /* registered again: the new form replaces the old */
      atomic_store_explicit(&stored_table[at], e, memory_order_release);
      stored_free(old);
      placed = 2;
    }
  }
  if (!placed) { /* the first removed slot of the chain, or the empty one that ends it */
    for (int i = 0; i < STORED_SLOTS && free_at < 0; i++) {
      size_t at = (h + i) % STORED_SLOTS;
      if (atomic_load(&stored_table[at]) == NULL)
        free_at = (int)at;
    }
    if (free_at >= 0) {
      atomic_store_explicit(&stored_table[free_at], e, memory_order_release);
      atomic_fetch_add(&stored_count, 1);
      placed = 1;
    }
  }
  pthread_mutex_unlock(&stored_lock);
  if (!placed)
    stored_free(e);
  return placed ? 1 : -1;
}

/* Forgets w's stored form (nothing if none): w is read as float32 again. The registrant calls
 * it once no product of w can be in flight. */
void specstream_stored_unregister(const float *w) {
  pthread_mutex_lock(&stored_lock);
  size_t h = stored_slot(w);
  for (int i = 0; i < STORED_SLOTS; i++) {
    size_t at = (h + i) % STORED_SLOTS;
    struct stored_weight *e = atomic_load(&stored_table[at]);
    if (e == NULL)
      break;
    if (e != &stored_gone && e->w == w) {
      atomic_store_explicit(&stored_table[at], &stored_gone, memory_order_release);
      atomic_fetch_sub(&stored_count, 1);
      stored_free(e);
      break;
    }
  }
  pthread_mutex_unlock(&stored_lock);
}

/* The entry registered for w, or NULL; the caller holds stored_lock. */
static struct stored_weight *registered(const float *w) {
  size_t h = stored_slot(w);
  for (int i = 0; i < STORED_SLOTS; i++) {
    struct stored_weight *e = atomic_load(&stored_table[(h + i) % STORED_SLOTS]);
    if (e == NULL)
      return NULL;
    if (e != &stored_gone && e->w == w)
      return e;
  }
  return NULL;
}

/* Products of up to `rows` rows by the registered weight w read its stored form, more rows its
 * float32 weight (the same bits either way). Returns 1, or 0 when w is not registered. */
int specstream_stored_set_rows(const float *w, int rows) {
  pthread_mutex_lock(&stored_lock);
  struct stored_weight *e = registered(w);
  if (e != NULL)
    atomic_store(&e->max_rows, rows < 0 ? 0 : rows);
  pthread_mutex_unlock(&stored_lock);
  return e != NULL;
}

/* Bytes a product of the registered weight w reads (its codes, scales and biases as held),
 * or 0 when w is not registered. */
long long specstream_stored_bytes(const float *w) {
  long long bytes = 0;
  pthread_mutex_lock(&stored_lock);
  const struct stored_weight *e = registered(w);
  if (e != NULL) {
    size_t groups = (size_t)e->n * (e->k / e->group);
    bytes = (long long)((size_t)e->n * e->row_bytes + 2 * groups * held_width(e));
  }
  pthread_mutex_unlock(&stored_lock);
  return bytes;
}

/* Whether weights registered from now on keep scales and biases that are all exactly float16 as
 * float16 (1, the default) or as the registrant's float32 (0); returns the setting before. */
int specstream_stored_half_set(int on) { return atomic_exchange(&stored_half, on != 0); }

/* Weights registered now, and products served from stored forms so far. */
int specstream_stored_count(void) { return atomic_load(&stored_count); }
long long specstream_stored_served(void) { return atomic_load(&stored_served); }

/* 8-bit activations: -1 where the kernel cannot (off, or a CPU without AVX2),
 * 0 off, 1 on, 2 on as two planes (16-bit); and the products computed with them so far. */
int specstream_q8_state(void) {
  if (kernel_rows() <= 0 || !q8_capable)
    return -1;
  return atomic_load(&q8_on);
}
long long specstream_q8_served(void) { return atomic_load(&q8_served); }

/* Turns 8-bit activations on (1), on as two planes (2) or off (0) within a process, for
 * measuring them against the float32 products setting by setting; only weights registered while
 * SPECSTREAM_PRODUCTS was q8 or q16 carry the layout. Returns the state (specstream_q8_state). */
int specstream_q8_set(int on) {
  if (kernel_rows() <= 0 || !q8_capable)
    return -1;
  on = on == 2 ? 2 : on != 0;
  atomic_store(&q8_on, on);
  return on;
}

/* Weights registered now whose products of up to FUSED_ROWS rows read repacked codes. */
int specstream_stored_repacked(void) {
  int count = 0;
  pthread_mutex_lock(&stored_lock);
  for (int i = 0; i < STORED_SLOTS; i++) {
    struct stored_weight *e = atomic_load(&stored_table[i]);
    count += e != NULL && e != &stored_gone && e->packed != NULL;
  }
  pthread_mutex_unlock(&stored_lock);
  return count;
}
#endif /* HAVE_X86 */

/* How much a waiting worker reads ahead, KB (SPECSTREAM_SKINNY_AHEAD_KB; -1: the kernel is
 * off), and the bytes it has read ahead so far. */
long specstream_skinny_ahead_kb(void) {
#if HAVE_X86
  return kernel_rows() > 0 ? (long)(atomic_load(&ahead_bytes) >> 10) : -1;
#else
  return -1;
#endif
}

long long specstream_skinny_ahead_read(void) {
#if HAVE_X86
  return atomic_load(&ahead_done);
#else
  return 0;
#endif
}

/* Sets how much a waiting worker reads ahead, KB, within a process: for measuring it against
 * none setting by setting in turn (examples/lock_spin_ab.py --setting ahead). */
void specstream_skinny_set_ahead_kb(long kb) {
#if HAVE_X86
  kernel_rows();
  atomic_store(&ahead_bytes, kb > 0 ? (size_t)kb << 10 : 0);
#else
  (void)kb;
#endif
}

/* Sets the elements from which a product by a thin operand is split between the threads
 * (THIN_PARALLEL_MIN; negative: that default) within a process: for measuring it against
 * other thresholds, or none, setting by setting (examples/lock_spin_ab.py --setting thin-min). */
void specstream_skinny_set_thin_min(long elements) {
#if HAVE_X86
  kernel_rows();
  atomic_store(&thin_parallel_min, elements < 0 ? THIN_PARALLEL_MIN : elements);
#else
  (void)elements;
#endif
}

/* Turns the vectorised loops of MLX's rewritten strided kernels (specstream_mlx/jit_strided.py)
 * off (1) or on (0) within a process, for measuring them against MLX's own loops; they read
 * it through a weak reference. */
int specstream_jit_strided_off = 0;
void specstream_jit_strided_set(int on) { specstream_jit_strided_off = !on; }

/* Whether the kernel takes the weights for streaming from memory (1) or cached (0). */
int specstream_skinny_streaming(void) {
#if HAVE_X86
  return atomic_load(&streaming);
#else
  return 0;
#endif
}

/* Reports the kernel for `specstream-mlx doctor`: the fewest and most rows it takes (most
 * 0: off), its threads and its vector width in bits (512: AVX-512, 256: AVX2). */
void specstream_skinny_info(int *min_rows, int *rows, int *threads, int *bits) {
  *rows = kernel_rows();
  *min_rows = *threads = *bits = 0;
#if HAVE_X86
  if (*rows > 0) {
    *min_rows = skinny_min_rows;
    *threads = pool.threads;
    *bits = use_avx512 ? 512 : 256;
  }
#endif
}

/* Reports how the kernel prefetches weight rows, for `doctor` and every benchmark's
 * header: 0 off, 1 nta (from two rows on), 2 t0, 3 t1 (-1: the kernel is off). */
int specstream_skinny_prefetch(void) {
#if HAVE_X86
  return kernel_rows() > 0 ? prefetch_mode : -1;
#else
  return -1;
#endif
}

void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha, const float *a, int lda,
                 const float *b, int ldb, float beta, float *c, int ldc) {
  if (!next_sgemm) {
    next_sgemv = (sgemv_fn)next_symbol("cblas_sgemv");
    next_sgemm = (sgemm_fn)next_symbol("cblas_sgemm");
  }
#if HAVE_X86
  /* One row too: as fast as OpenBLAS's two-thread GEMV on a quiet machine, and on a
   * loaded one the pool's caller never waits for a worker without a core, where
   * OpenBLAS's GEMV took 2-3x as long (docs/DESIGN.md decision 15). */
  int most = kernel_rows();
  int layout = order == ROW_MAJOR && ta == NO_TRANS && (tb == TRANS || tb == NO_TRANS) && k >= 1 && n >= 1;
  /* More rows than a tile takes, by a small operand: attention's products in a tree pass, a
   * key/value head's queries folded into the rows of one product (SmolLM2's 17-row stream
   * layers: 51 rows) against the head's keys or values, a few hundred KB at most. They run
   * in equal blocks of rows the tiles take, each reading that operand from the cache again. */
  int blocked = most > 1 && m <= BLOCKED_MAX_ROWS && (long)n * k <= BLOCKED_MAX_WEIGHT;
  const struct stored_weight *found = layout && most > 0 && tb == TRANS ? find_stored(b, n, k, ldb) : NULL;
  if (q8_reads(found)) {
    /* Every product of a weight with the 8-bit-activation layout, whatever its rows: its
     * outputs are the same bits for a row whichever product carries it. */
    product_t p = {1, m, n, k, lda, ldb, ldc, alpha, beta, a, b, c, found, NULL, NULL, NULL, 1};
    if (q8_product(&p, q8_planes()))
      return;
  }
  if (layout && m >= skinny_min_rows && (m <= most || blocked)) {
    int blocks = (m + most - 1) / most;
    const struct stored_weight *stored = stored_for(found, m);
    for (int i = 0, i0 = 0; i < blocks; i++) {
      int rows = (m - i0) / (blocks - i);
      product_t p = {tb == TRANS, rows, n, k, lda, ldb, ldc, alpha, beta, a + (size_t)i0 * lda, b, c + (size_t)i0 * ldc,
                     stored};
      if (stored)
        atomic_fetch_add_explicit(&stored_served, 1, memory_order_relaxed);
      skinny_product(&p);
      i0 += rows;
    }
    return;
  }
#endif
  if (order == ROW_MAJOR && m == 1 && next_sgemv) {
    /* a is one row: contiguous (no transpose), or one column of a (k x 1) with stride lda. */
    int inc_a = ta == NO_TRANS ? 1 : lda;
    if (tb == TRANS) /* b is (n x k): c = b a */
      next_sgemv(ROW_MAJOR, NO_TRANS, n, k, alpha, b, ldb, a, inc_a, beta, c, 1);
    else /* b is (k x n): c = b^T a */
      next_sgemv(ROW_MAJOR, TRANS, k, n, alpha, b, ldb, a, inc_a, beta, c, 1);
    return;
  }
  next_sgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
