/*
 * seccomp-exec: run a command under the seccomp filters that systemd builds
 * for three of moed.service's directives, so they can be tried against the
 * real daemon (and CUDA) on a machine without systemd. Used by check.sh.
 *
 *   seccomp-exec [--mdwe] [--allow FILE] [--af-unix] -- COMMAND [ARGS]
 *
 *   --mdwe        MemoryDenyWriteExecute=yes, as systemd's seccomp filter
 *                 does it: mmap() asking for PROT_WRITE|PROT_EXEC, and
 *                 mprotect()/pkey_mprotect() asking for PROT_EXEC, and
 *                 shmat() with SHM_EXEC fail with EPERM.
 *   --allow FILE  SystemCallFilter= as an allow list: the system call numbers
 *                 in FILE (one a line) run, every other fails with EPERM
 *                 (SystemCallErrorNumber=EPERM); with SystemCallArchitectures=
 *                 native, other ABIs are killed.
 *   --af-unix     RestrictAddressFamilies=AF_UNIX: socket() of another family
 *                 fails with EAFNOSUPPORT.
 *
 * Sets no_new_privs first (NoNewPrivileges=yes; seccomp needs it). x86-64.
 *   cc -O2 -o seccomp-exec seccomp-exec.c
 */
#include <errno.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/shm.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#define MAXI 4096
static struct sock_filter prog[MAXI];
static int n;

static void emit(unsigned short code, unsigned char jt, unsigned char jf, unsigned int k)
{
    if (n == MAXI) {
        fprintf(stderr, "seccomp-exec: filter too long\n");
        exit(126);
    }
    prog[n++] = (struct sock_filter)BPF_JUMP(code, k, jt, jf);
}

#define LD_NR() emit(BPF_LD | BPF_W | BPF_ABS, 0, 0, offsetof(struct seccomp_data, nr))
#define LD_ARG(i) emit(BPF_LD | BPF_W | BPF_ABS, 0, 0, offsetof(struct seccomp_data, args[i]))
#define RET(v) emit(BPF_RET | BPF_K, 0, 0, (v))

/* If the call is nr and (arg & mask) == mask, fail with err; else go on. */
static void deny_flags(int nr, int arg, unsigned mask, int err)
{
    LD_NR();
    emit(BPF_JMP | BPF_JEQ | BPF_K, 0, 4, (unsigned)nr);
    LD_ARG(arg);
    emit(BPF_ALU | BPF_AND | BPF_K, 0, 0, mask);
    emit(BPF_JMP | BPF_JEQ | BPF_K, 0, 1, mask);
    RET(SECCOMP_RET_ERRNO | (unsigned)err);
}

int main(int argc, char **argv)
{
    int mdwe = 0, afunix = 0, i = 1;
    const char *allow = NULL;
    for (; i < argc && strcmp(argv[i], "--"); i++) {
        if (!strcmp(argv[i], "--mdwe"))
            mdwe = 1;
        else if (!strcmp(argv[i], "--af-unix"))
            afunix = 1;
        else if (!strcmp(argv[i], "--allow") && i + 1 < argc)
            allow = argv[++i];
        else {
            fprintf(stderr, "usage: seccomp-exec [--mdwe] [--allow FILE] [--af-unix] -- CMD...\n");
            return 126;
        }
    }
    if (i + 1 >= argc) {
        fprintf(stderr, "seccomp-exec: no command\n");
        return 126;
    }
    emit(BPF_LD | BPF_W | BPF_ABS, 0, 0, offsetof(struct seccomp_data, arch));
    emit(BPF_JMP | BPF_JEQ | BPF_K, 1, 0, AUDIT_ARCH_X86_64);
    RET(SECCOMP_RET_KILL_PROCESS);
    if (afunix) {
        /* socket(family, ...): anything but AF_UNIX is refused. */
        LD_NR();
        emit(BPF_JMP | BPF_JEQ | BPF_K, 0, 3, SYS_socket);
        LD_ARG(0);
        emit(BPF_JMP | BPF_JEQ | BPF_K, 1, 0, AF_UNIX);
        RET(SECCOMP_RET_ERRNO | EAFNOSUPPORT);
    }
    if (mdwe) {
        deny_flags(SYS_mmap, 2, PROT_WRITE | PROT_EXEC, EPERM);
        deny_flags(SYS_mprotect, 2, PROT_EXEC, EPERM);
        deny_flags(SYS_pkey_mprotect, 2, PROT_EXEC, EPERM);
        deny_flags(SYS_shmat, 2, SHM_EXEC, EPERM);
    }
    LD_NR();
    /* Other ABIs on x86-64 (x32) set bit 30 of nr. */
    emit(BPF_JMP | BPF_JGE | BPF_K, 0, 1, 0x40000000u);
    RET(SECCOMP_RET_KILL_PROCESS);
    if (allow) {
        FILE *f = fopen(allow, "r");
        unsigned nr;
        if (!f) {
            perror(allow);
            return 126;
        }
        while (fscanf(f, "%u", &nr) == 1) {
            emit(BPF_JMP | BPF_JEQ | BPF_K, 0, 1, nr);
            RET(SECCOMP_RET_ALLOW);
        }
        fclose(f);
        RET(SECCOMP_RET_ERRNO | EPERM);
    } else {
        RET(SECCOMP_RET_ALLOW);
    }
    struct sock_fprog fp = {.len = (unsigned short)n, .filter = prog};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0 ||
        prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &fp) < 0) {
        perror("seccomp-exec: prctl");
        return 126;
    }
    execvp(argv[i + 1], argv + i + 1);
    perror(argv[i + 1]);
    return 127;
}
