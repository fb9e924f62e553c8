// ARM64 builds only (CMakeLists.txt): keep the library loadable on glibc 2.28, the glibc that
// onnxruntime's own aarch64 wheels need (manylinux_2_28), although the cross toolchain links
// against Debian 12's glibc 2.36. The statically linked libstdc++ (and nothing in fusecli's own
// code) asks glibc for symbols newer than 2.28; each is handled here or by a link option:
//   __libc_single_threaded (GLIBC_2.32; libstdc++'s guard.o, thread.o, stdexcept.o, the string
//     instantiations): defined below, hidden, as 0, so libstdc++ always takes its atomic path,
//     which is correct in every process (glibc before 2.32 had no such flag; libstdc++ built
//     against it behaves the same way).
//   pthread_create, pthread_join, pthread_detach (GLIBC_2.34, libstdc++'s thread.o, std::thread):
//     glibc 2.34 moved them from libpthread.so.0 into libc.so.6 under a new version; the old
//     GLIBC_2.17 versions remain in libc.so.6 as the same functions. The link wraps the three
//     names (-Wl,--wrap=...) to the functions below, which call the GLIBC_2.17 versions
//     (.symver); the library also needs libpthread.so.0, which holds them on glibc < 2.34 (a stub
//     on newer ones).
//   arc4random (GLIBC_2.36) and getentropy: only std::random_device (libstdc++'s random.o, dragged
//     in by the COW-string instantiations) uses them and nothing calls it: -Wl,--gc-sections drops
//     that code.
//   _dl_find_object (GLIBC_2.35), pthread_once, __pthread_key_create (GLIBC_2.34): libgcc's
//     unwinder; the ARM64 library uses the system's libgcc_s.so.1 (which onnxruntime needs too)
//     instead of linking libgcc_eh.a in.
// scripts/build_lib.sh fails the cross build when the library needs a newer GLIBC_ version than
// its stated floor.
#include <pthread.h>

extern "C" {

__attribute__((visibility("hidden"))) char __libc_single_threaded = 0;

int fusecli_pthread_create_2_17(pthread_t*, const pthread_attr_t*, void* (*)(void*), void*);
int fusecli_pthread_join_2_17(pthread_t, void**);
int fusecli_pthread_detach_2_17(pthread_t);
__asm__(".symver fusecli_pthread_create_2_17, pthread_create@GLIBC_2.17");
__asm__(".symver fusecli_pthread_join_2_17, pthread_join@GLIBC_2.17");
__asm__(".symver fusecli_pthread_detach_2_17, pthread_detach@GLIBC_2.17");

__attribute__((visibility("hidden"))) int __wrap_pthread_create(pthread_t* thread,
                                                                const pthread_attr_t* attr,
                                                                void* (*start)(void*), void* arg) {
  return fusecli_pthread_create_2_17(thread, attr, start, arg);
}
__attribute__((visibility("hidden"))) int __wrap_pthread_join(pthread_t thread, void** result) {
  return fusecli_pthread_join_2_17(thread, result);
}
__attribute__((visibility("hidden"))) int __wrap_pthread_detach(pthread_t thread) {
  return fusecli_pthread_detach_2_17(thread);
}

}  // extern "C"
