/* What every AMX kernel needs before its first tile instruction (cpu_prefill_attention.c,
 * cpu_linear_amx.c): the OS's leave to use the tile state, and a tile configuration. */
#ifndef KVSCALE_CPU_AMX_H
#define KVSCALE_CPU_AMX_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Linux hands out AMX's tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM for
 * XFEATURE_XTILEDATA); the grant is for the whole process and lasts, so asking once is enough. */
static inline int amx_permitted(void) {
    static int state; /* 0 unknown, 1 granted, -1 refused; a racing second ask is harmless */
    if (state == 0) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) == 0 ? 1 : -1;
    return state == 1;
}

typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* All eight tiles 16 rows of 64 bytes (per thread: the configuration is thread state). */
static inline void configure_tiles(void) {
    tile_config config;
    memset(&config, 0, sizeof config);
    config.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        config.colsb[t] = 64;
        config.rows[t] = 16;
    }
    _tile_loadconfig(&config);
}

#endif
