/* The binary unit suffix shared by the fake driver's FAKECUDA_MEM and the test clients' sizes:
 * k/m/g/t in any case, optionally followed by i and/or b (8g = 8G = 8GB = 8GiB = 8 * 2^30).
 * Returns the shift (0 when there is no unit) and advances *p past the suffix. */
#ifndef FAKECUDA_SIZE_SUFFIX_H
#define FAKECUDA_SIZE_SUFFIX_H

static inline int size_suffix_shift(const char **p)
{
    int shift;

    switch (**p | 0x20) {
    case 'k': shift = 10; break;
    case 'm': shift = 20; break;
    case 'g': shift = 30; break;
    case 't': shift = 40; break;
    default: return 0;
    }
    (*p)++;
    if ((**p | 0x20) == 'i')
        (*p)++;
    if ((**p | 0x20) == 'b')
        (*p)++;
    return shift;
}

#endif
