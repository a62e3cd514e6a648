/* Runs the native kernels' projections and row dequantization on cases read from a file, for
 * test_native_neon.py: linked with native.c cross-built for aarch64 and run under qemu-user.
 *
 * usage: neon_driver CASES RESULTS
 * CASES holds cases back to back, each six little-endian int64 (type code, activations code, scalar,
 * tokens, rows, cols), the weight's bytes (rows * pie_weight_row_bytes(type, cols)), then x as float32
 * [tokens, cols]. RESULTS gets for each case an int32 (pie_quant_config's answer), pie_linear's y as
 * float32 [tokens, rows], then every weight row through pie_dequantize_rows as float32 [rows, cols].
 * Every pass takes the integer path its case asks for, however many tokens it has. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

/* The entry points native.py binds through ctypes (the same signatures). */
int pie_set_threads(int threads);
int pie_quant_config(int activations, int scalar, long max_tokens);
long pie_weight_row_bytes(int type, long cols);
int pie_linear(const void *w, int type, const float *x, const float *bias, const float *residual, float *y,
               long tokens, long rows, long cols);
void pie_dequantize_rows(const void *table, int type, const int *ids, long count, long cols, float *out);

#define ALL_TOKENS (1L << 30)

static void *read_exactly(FILE *in, size_t bytes, const char *what) {
    void *data = malloc(bytes ? bytes : 1);
    if (!data || fread(data, 1, bytes, in) != bytes) {
        fprintf(stderr, "neon_driver: the cases file ends inside a case's %s (%zu bytes expected)\n", what, bytes);
        exit(2);
    }
    return data;
}

static void write_exactly(FILE *out, const void *data, size_t bytes) {
    if (fwrite(data, 1, bytes, out) != bytes) {
        fprintf(stderr, "neon_driver: cannot write the results\n");
        exit(2);
    }
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s CASES RESULTS\n", argv[0]);
        return 2;
    }
    FILE *in = fopen(argv[1], "rb"), *out = fopen(argv[2], "wb");
    if (!in || !out) {
        fprintf(stderr, "neon_driver: cannot open %s or %s\n", argv[1], argv[2]);
        return 2;
    }
    pie_set_threads(2); /* the projections of 65536 weight elements and more run on both threads */
    int64_t header[6];
    for (;;) {
        size_t got = fread(header, 1, sizeof header, in);
        if (got == 0 && feof(in)) break;
        if (got != sizeof header) {
            fprintf(stderr, "neon_driver: the cases file ends inside a case's header\n");
            return 2;
        }
        int type = (int)header[0], activations = (int)header[1], scalar = (int)header[2];
        long tokens = (long)header[3], rows = (long)header[4], cols = (long)header[5];
        if (tokens < 1 || rows < 1 || cols < 1) {
            fprintf(stderr, "neon_driver: a case has %ld tokens, %ld rows, %ld cols\n", tokens, rows, cols);
            return 2;
        }
        size_t weight_bytes = (size_t)(rows * pie_weight_row_bytes(type, cols));
        void *weight = read_exactly(in, weight_bytes, "weight");
        float *x = read_exactly(in, sizeof(float) * tokens * cols, "activations");
        float *y = malloc(sizeof(float) * tokens * rows), *rows_out = malloc(sizeof(float) * rows * cols);
        int *ids = malloc(sizeof(int) * rows);
        if (!y || !rows_out || !ids) {
            fprintf(stderr, "neon_driver: out of memory\n");
            return 2;
        }
        int32_t vector = pie_quant_config(activations, scalar, ALL_TOKENS);
        if (pie_linear(weight, type, x, NULL, NULL, y, tokens, rows, cols) != 0) {
            fprintf(stderr, "neon_driver: pie_linear could not allocate its scratch\n");
            return 2;
        }
        for (long r = 0; r < rows; r++) ids[r] = (int)r;
        pie_dequantize_rows(weight, type, ids, rows, cols, rows_out);
        write_exactly(out, &vector, sizeof vector);
        write_exactly(out, y, sizeof(float) * tokens * rows);
        write_exactly(out, rows_out, sizeof(float) * rows * cols);
        free(weight), free(x), free(y), free(rows_out), free(ids);
    }
    if (ferror(in) || fclose(out) != 0) {
        fprintf(stderr, "neon_driver: reading the cases or writing the results failed\n");
        return 2;
    }
    fclose(in);
    return 0;
}
