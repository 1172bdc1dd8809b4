/* Sums by dtype: the aggregator's only arithmetic, and a rank's for adding its own chunk to a
 * result and for averages. Rows are summed in rank order, so the result has the same bits
 * whatever order the contributions came in. float32, float64 and the integers are summed in
 * their own type (integers wrap, as numpy's do); bfloat16 and float16 are accumulated in float32
 * and rounded once, to nearest even. The loops are plain C the compiler vectorizes, built once
 * for AVX2 and once for the baseline, chosen at load time. Nothing is kept: the rows and `out`
 * are the caller's, touched during the call only. */
#ifndef OVERCAST_NATIVE_SUMS_H
#define OVERCAST_NATIVE_SUMS_H

#include <stddef.h>
#include <stdint.h>

/* The wire's dtype codes (overcast.buffers.dtype_code: the dtypes sorted by name). */
enum oc_dtype {
    OC_BFLOAT16 = 0, OC_FLOAT16 = 1, OC_FLOAT32 = 2, OC_FLOAT64 = 3,
    OC_INT32 = 4, OC_INT64 = 5, OC_INT8 = 6, OC_UINT8 = 7, OC_DTYPES = 8,
};

/* Bytes per element, 0 for an unknown code. */
size_t oc_dtype_size(unsigned code);

/* out = the sum of rows 0 .. nrows - 1 but `skip`, `elems` elements each, in row order, row r
 * at rows + r * stride but row `late` at `late_row` (none if late >= nrows); no alignment is
 * assumed. Zeros if no row is left. `out` may be row `skip` itself, never another. */
void oc_sum_rows(unsigned code, uint8_t *out, const uint8_t *rows, size_t stride,
                 unsigned nrows, unsigned skip, size_t elems, unsigned late,
                 const uint8_t *late_row);

/* out = a + b, `elems` elements of the dtype, each summed as oc_sum_rows sums two rows (a
 * rank's own contribution added to the aggregator's sum). No alignment is assumed: `a` may be a
 * datagram's payload. `out` may be `a` or `b`. */
void oc_add_pair(unsigned code, uint8_t *out, const uint8_t *a, const uint8_t *b, size_t elems);
/* out /= divisor in place (an average): float32 and float64 in their own type, 16-bit floats in
 * float32 and rounded once, integers (their sums wrapped) truncated toward zero, as NCCL
 * averages integers (the quotient taken in int64, so any divisor is exact). */
void oc_divide(unsigned code, uint8_t *out, size_t elems, unsigned divisor);

float oc_half_to_float(uint16_t h);
uint16_t oc_float_to_half(float f);
float oc_bfloat_to_float(uint16_t b);
uint16_t oc_float_to_bfloat(float f);

#endif
