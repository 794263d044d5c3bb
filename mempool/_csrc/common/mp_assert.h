/* Graded internal asserts (as mimalloc's mi_assert / mi_assert_internal / mi_assert_expensive).
 *
 * - mp_check(cond):   cheap, always on, release builds included. Guards a condition whose
 *                     breach would otherwise corrupt memory silently (a reference count
 *                     going negative, a page index past its range): better a clear abort
 *                     naming the line than a double free found a day later.
 * - mp_assert(cond):  debug build only (MP_DEBUG, set by MEMPOOL_DEBUG=1 at build time):
 *                     internal consistency on paths Python never sees (the PyTorch entry
 *                     points, DLPack deleters, page maps).
 * - mp_assert_expensive(cond): debug build only, for checks that walk a structure.
 *
 * None of them takes a lock or the GIL: a failure prints one line on stderr and aborts, so
 * they are safe in the deleters and entry points that run on foreign threads. Conditions
 * must have no side effects: the debug-only grades vanish from release builds.
 */
#ifndef MP_ASSERT_H
#define MP_ASSERT_H

#include <stdio.h>
#include <stdlib.h>

#ifndef MP_DEBUG
#define MP_DEBUG 0
#endif

static inline void mp_assert_fail(const char *grade, const char *cond, const char *file,
                                  int line, const char *func) {
    fprintf(stderr, "mempool: %s failed: %s (%s:%d, %s)\n", grade, cond, file, line, func);
    fflush(stderr);
    abort();
}

#define mp_check(cond) \
    (__builtin_expect(!!(cond), 1) ? (void)0 \
                                   : mp_assert_fail("check", #cond, __FILE__, __LINE__, __func__))

#if MP_DEBUG
#define mp_assert(cond) \
    ((cond) ? (void)0 : mp_assert_fail("assert", #cond, __FILE__, __LINE__, __func__))
#define mp_assert_expensive(cond) \
    ((cond) ? (void)0 : mp_assert_fail("expensive assert", #cond, __FILE__, __LINE__, __func__))
#else
#define mp_assert(cond) ((void)0)
#define mp_assert_expensive(cond) ((void)0)
#endif

#endif
