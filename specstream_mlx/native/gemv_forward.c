/* One-row matrix products as matrix-vector products.
 *
 * MLX's CPU backend computes every matrix product with cblas_sgemm, also the one-row
 * products of a decoding step (x (1 x k) times a weight). Debian's OpenBLAS 0.3.21 and
 * BLIS 0.9 run that case through their general GEMM path, which streams the weight
 * well below the memory bandwidth; their cblas_sgemv reads it at close to the
 * bandwidth (bench/blas.md). Preloaded before the BLAS, this library takes
 * cblas_sgemm, forwards row-major calls with m == 1 to the next library's cblas_sgemv
 * and every other call to the next library's cblas_sgemm unchanged.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

enum { ROW_MAJOR = 101 };
enum { NO_TRANS = 111, TRANS = 112 };

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
    fprintf(stderr, "specstream-mlx: the one-row forwarder found no %s to forward to\n", name);
    abort();
  }
  return f;
}

void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha, const float *a, int lda,
                 const float *b, int ldb, float beta, float *c, int ldc) {
  if (!next_sgemm) {
    next_sgemv = (sgemv_fn)next_symbol("cblas_sgemv");
    next_sgemm = (sgemm_fn)next_symbol("cblas_sgemm");
  }
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
