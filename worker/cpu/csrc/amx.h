/* AMX tiles for the kernels that use them (linear.c, paged_prefill.c): the tile configuration,
 * and whether this process holds the tile state (`linear_enable_amx` asks Linux for it once,
 * at load). Every tile here has 64-byte rows (16 float32 or 32 bfloat16). */
#ifndef SPECSERVE_AMX_H
#define SPECSERVE_AMX_H

#include <stdint.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define SPECSERVE_AMX 1
#include <immintrin.h>

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) amx_config;

/* Tiles 0-7 with `rows[t]` rows of 64 bytes each, for the calling thread. */
static inline void amx_configure_rows(const uint8_t rows[8]) {
    amx_config cfg = {0};
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = rows[t];
    _tile_loadconfig(&cfg);
}
#endif

/* The fewest rows of a bfloat16 input that linear.c multiplies on the tiles; 0 while this
 * process has no tile state (or the CPU or the build has no tiles). */
int64_t linear_amx_min_rows(void);

#endif
