#ifndef STOCKADE_HS_LAZY_H
#define STOCKADE_HS_LAZY_H
/* Vectorscan is loaded on first use (core/hs_lazy.c): the hs.h API as usual, no library
 * mapped until a policy compiles a regex redactor. */
#include <stdbool.h>

/* Whether the library has been loaded in this process (for tests and doctor). */
bool hs_lazy_loaded(void);

#endif
