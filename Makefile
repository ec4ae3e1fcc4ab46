# moed: build, test, run, install.
#
#   make            build build/moed, build/moectl, build/libmoe.{so,a}
#   make test       unit and integration tests, fuzzing for FUZZ_TEST_SECONDS per
#                   target (tests/run.sh), summary last
#   make fuzz       the libFuzzer targets (clang), FUZZ_SECONDS each
#   make fuzz-corpus  regenerate the seed corpus in tests/fuzz/corpus
#   make run        the demo: daemon on a generated layer, a checked forward, a bench
#   make bench      kernel benchmarks (GPU machine)
#   make install    PREFIX=/usr/local DESTDIR= (binaries, library, units, config, man pages)
#   make uninstall  the same variables: removes what install put there
#   make deb        build/moed_<version>-1_<arch>.deb with dpkg-deb
#   make deps       install the Debian build dependencies (apt-get, as root)
#   SAN=1           build with AddressSanitizer and UndefinedBehaviorSanitizer
#
# The CUDA kernels are built when nvcc is found (NVCC=, else PATH, else
# /usr/local/cuda/bin); without it the build is CPU-only and says so.

BUILD   ?= build
PREFIX  ?= /usr/local
DESTDIR ?=
VERSION := 0.1.0

CC      ?= cc
V       ?= 0
ifeq ($(V),0)
Q := @
endif
NVCC    ?= $(shell command -v nvcc 2>/dev/null || { test -x /usr/local/cuda/bin/nvcc && echo /usr/local/cuda/bin/nvcc; })
CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(NVCC))

OPT     ?= -O2
WARN    := -Wall -Wextra -Wno-unused-parameter -Wshadow -Wstrict-prototypes \
           -Wmissing-prototypes -Werror=implicit-function-declaration -Wvla
# -ffp-contract=off: the CPU kernels promise bit-identical results per token,
# which fused multiply-adds chosen differently per code path would break.
CFLAGS  ?= $(OPT) -g
CFLAGS  += -std=c11 -D_GNU_SOURCE -fPIC -pthread -ffp-contract=off $(WARN) \
           -I. -Ikernels -Iclient -I$(BUILD)/gen -MMD -MP \
           -DMOE_VERSION=\"$(VERSION)\"
LDFLAGS += -pthread
LIBS    := -lzmq -lprotobuf-c -lsystemd -lcjson -linih -lm

ifeq ($(SAN),1)
SANFLAGS := -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
CFLAGS   += $(SANFLAGS)
LDFLAGS  += $(SANFLAGS)
BUILD    := build-san
endif

DEB_PKGS := libzmq3-dev libprotobuf-c-dev protobuf-c-compiler libsystemd-dev \
            libcjson-dev libinih-dev pkg-config systemd dpkg-dev clang libclang-rt-14-dev

# ---- sources ---------------------------------------------------------------
PROTO_C   := $(BUILD)/gen/moe.pb-c.c
PROTO_H   := $(BUILD)/gen/moe.pb-c.h
KERN_SRC  := $(wildcard kernels/cpu/*.c)
DAEMON_SRC := $(filter-out daemon/main.c,$(wildcard daemon/*.c))
CLIENT_SRC := $(filter-out client/moectl%.c,$(wildcard client/*.c))
MOECTL_SRC := $(wildcard client/moectl*.c)
CUDA_SRC  := $(if $(NVCC),$(wildcard kernels/cuda/*.cu))

obj = $(patsubst %.c,$(BUILD)/obj/%.o,$(1))
PROTO_O   := $(BUILD)/obj/gen/moe.pb-c.o $(call obj,$(wildcard proto/*.c))
KERN_O    := $(call obj,$(KERN_SRC))
DAEMON_O  := $(call obj,$(DAEMON_SRC))
CLIENT_O  := $(call obj,$(CLIENT_SRC))
MOECTL_O  := $(call obj,$(MOECTL_SRC))
CUDA_O    := $(patsubst %.cu,$(BUILD)/obj/%.o,$(CUDA_SRC))

ifneq ($(CUDA_SRC),)
CFLAGS     += -DMOE_HAVE_CUDA=1 -I$(CUDA_HOME)/include
CUDA_LIBS  := -L$(CUDA_HOME)/lib64 -lcudart_static -ldl -lrt -lstdc++ \
              -Wl,-rpath,$(CUDA_HOME)/lib64
NVCCFLAGS  ?= -O3 -std=c++17 -lineinfo -Xcompiler -fPIC \
              -gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_90,code=compute_90
NVCCFLAGS  += -Ikernels
endif

# The CUDA kernel test links the CUDA objects: only with nvcc.
UNIT_SRC  := $(filter-out $(if $(CUDA_SRC),,tests/unit/test_cuda_kernels.c),$(wildcard tests/unit/test_*.c))
ITEST_SRC := $(wildcard tests/integration/itest_*.c)
UNIT_BIN  := $(patsubst tests/unit/%.c,$(BUILD)/tests/%,$(UNIT_SRC))
ITEST_BIN := $(patsubst tests/integration/%.c,$(BUILD)/tests/%,$(ITEST_SRC))

BINS := $(BUILD)/moed $(BUILD)/moectl $(BUILD)/libmoe.so $(BUILD)/libmoe.a $(BUILD)/libmoe.pc

# ---- fuzzing ---------------------------------------------------------------
# libFuzzer targets (tests/fuzz/fuzz_*.c) need clang; they are built with
# AddressSanitizer and UndefinedBehaviorSanitizer into $(BUILD)/fuzz/. The same
# sources, with tests/fuzz/replay.c as main, build with $(CC) into
# $(BUILD)/tests/test_fuzz_*, which `make test` runs (SAN=1 too) to replay the
# seed corpus and every crash regression once (and the seeds again under a
# storm of signals). Under SAN=1 make test does not fuzz: the plain run does.
FUZZ_CC      ?= $(shell command -v clang 2>/dev/null)
FUZZ_SECONDS ?= 120
FUZZ_TEST_SECONDS ?= $(if $(filter 1,$(SAN)),0,30)
FUZZ_TARGETS := request safetensors config
FUZZ_DIR     := $(BUILD)/fuzz
FUZZ_SAN     := -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer
FUZZ_CFLAGS  := -O1 -g -std=c11 -D_GNU_SOURCE -pthread -ffp-contract=off -Wall -Wno-unused-parameter \
                -I. -Ikernels -Iclient -I$(BUILD)/gen -MMD -MP -DMOE_VERSION=\"$(VERSION)\" \
                -fsanitize=fuzzer-no-link $(FUZZ_SAN)
FUZZ_LIB_O   := $(patsubst %.c,$(FUZZ_DIR)/obj/%.o,$(DAEMON_SRC) $(KERN_SRC) $(wildcard proto/*.c)) \
                $(FUZZ_DIR)/obj/gen/moe.pb-c.o
FUZZ_BIN     := $(patsubst %,$(FUZZ_DIR)/fuzz_%,$(FUZZ_TARGETS))
FUZZ_REPLAY  := $(patsubst %,$(BUILD)/tests/test_fuzz_%,$(FUZZ_TARGETS))

.PHONY: all deps test run bench install clean cuda-note fuzz fuzz-build fuzz-corpus
all: $(BINS) cuda-note

cuda-note:
ifeq ($(NVCC),)
	@echo "note: nvcc not found; built CPU-only (the CUDA backend is not compiled)"
endif

# Installs what is missing, once per build tree; a machine that has it all
# never needs root.
deps: $(BUILD)/.deps
$(BUILD)/.deps:
	@mkdir -p $(BUILD)
	@missing=$$(for p in $(DEB_PKGS); do \
	  case "$$(dpkg-query -W -f='$${db:Status-Status}' $$p 2>/dev/null)" in \
	    installed) ;; *) echo $$p ;; esac; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing build dependencies:" $$missing; \
	  if [ "$$(id -u)" != 0 ]; then echo "make deps: run as root (apt-get) or install:" $$missing >&2; exit 1; fi; \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing; \
	fi
	@touch $@

$(PROTO_C) $(PROTO_H): proto/moe.proto | $(BUILD)/.deps
	@mkdir -p $(BUILD)/gen
	@echo "  PROTOC  $<"
	$(Q)protoc-c --proto_path=proto --c_out=$(BUILD)/gen proto/moe.proto

$(BUILD)/obj/gen/%.o: $(BUILD)/gen/%.c
	@mkdir -p $(dir $@)
	@echo "  CC      $<"
	$(Q)$(CC) $(CFLAGS) -Wno-missing-prototypes -c -o $@ $<

$(BUILD)/obj/%.o: %.c $(PROTO_H) | $(BUILD)/.deps
	@mkdir -p $(dir $@)
	@echo "  CC      $<"
	$(Q)$(CC) $(CFLAGS) -c -o $@ $<

$(BUILD)/obj/%.o: %.cu kernels/moe_kernels.h $(wildcard kernels/cuda/*.cuh kernels/cuda/*.h)
	@mkdir -p $(dir $@)
	@echo "  NVCC    $<"
	$(Q)$(NVCC) $(NVCCFLAGS) -c -o $@ $<

$(BUILD)/moed: $(BUILD)/obj/daemon/main.o $(DAEMON_O) $(KERN_O) $(CUDA_O) $(PROTO_O)
	@echo "  LINK    $@"
	$(Q)$(CC) $(LDFLAGS) -o $@ $^ $(LIBS) $(CUDA_LIBS)

$(BUILD)/libmoe.a: $(CLIENT_O) $(PROTO_O)
	@rm -f $@
	@echo "  AR      $@"
	$(Q)ar rcs $@ $^

$(BUILD)/libmoe.so: $(CLIENT_O) $(PROTO_O) client/libmoe.map
	@echo "  LINK    $@"
	$(Q)$(CC) $(LDFLAGS) -shared -Wl,-soname,libmoe.so.0 -Wl,--version-script=client/libmoe.map -o $@ $(filter %.o,$^) -lzmq -lprotobuf-c

$(BUILD)/libmoe.pc: client/libmoe.pc.in
	sed -e 's|@PREFIX@|$(PREFIX)|g' -e 's|@VERSION@|$(VERSION)|g' $< > $@

# moectl's --check reads the layer's weights with the daemon's own reader.
MOECTL_DAEMON_O := $(call obj,daemon/safetensors.c daemon/layer_read.c daemon/util.c)
$(BUILD)/moectl: $(MOECTL_O) $(MOECTL_DAEMON_O) $(BUILD)/libmoe.a $(KERN_O)
	@echo "  LINK    $@"
	$(Q)$(CC) $(LDFLAGS) -o $@ $(MOECTL_O) $(MOECTL_DAEMON_O) $(BUILD)/libmoe.a $(KERN_O) -lzmq -lprotobuf-c -lcjson -lm

# Tests link every module but the two mains, so each can test any module.
TEST_LINK := $(DAEMON_O) $(CLIENT_O) $(KERN_O) $(CUDA_O) $(PROTO_O)
$(BUILD)/tests/%: tests/unit/%.c $(TEST_LINK) tests/harness.h $(PROTO_H)
	@mkdir -p $(dir $@)
	@echo "  TEST    $@"
	$(Q)$(CC) $(CFLAGS) $(LDFLAGS) -o $@ $< $(TEST_LINK) $(LIBS) $(CUDA_LIBS)
$(BUILD)/tests/%: tests/integration/%.c $(TEST_LINK) tests/harness.h $(PROTO_H)
	@mkdir -p $(dir $@)
	@echo "  TEST    $@"
	$(Q)$(CC) $(CFLAGS) $(LDFLAGS) -o $@ $< $(TEST_LINK) $(LIBS) $(CUDA_LIBS)

# The replay binaries: one per fuzz target, linked like the unit tests.
$(BUILD)/tests/test_fuzz_%: tests/fuzz/fuzz_%.c tests/fuzz/replay.c tests/fuzz/fuzz.h $(TEST_LINK) tests/harness.h $(PROTO_H)
	@mkdir -p $(dir $@)
	@echo "  TEST    $@"
	$(Q)$(CC) $(CFLAGS) $(LDFLAGS) -DFUZZ_TARGET=\"$*\" -o $@ tests/fuzz/fuzz_$*.c tests/fuzz/replay.c \
	  $(TEST_LINK) $(LIBS) $(CUDA_LIBS)

$(FUZZ_DIR)/obj/gen/%.o: $(BUILD)/gen/%.c
	@mkdir -p $(dir $@)
	@echo "  FUZZCC  $<"
	$(Q)$(FUZZ_CC) $(FUZZ_CFLAGS) -c -o $@ $<
$(FUZZ_DIR)/obj/%.o: %.c $(PROTO_H) | $(BUILD)/.deps
	@mkdir -p $(dir $@)
	@echo "  FUZZCC  $<"
	$(Q)$(FUZZ_CC) $(FUZZ_CFLAGS) -c -o $@ $<
$(FUZZ_DIR)/fuzz_%: $(FUZZ_DIR)/obj/tests/fuzz/fuzz_%.o $(FUZZ_LIB_O)
	@echo "  FUZZLD  $@"
	$(Q)$(FUZZ_CC) -fsanitize=fuzzer $(FUZZ_SAN) -pthread -o $@ $^ $(LIBS)

fuzz-build: $(if $(FUZZ_CC),$(FUZZ_BIN))
ifeq ($(FUZZ_CC),)
	@echo "note: clang not found; the libFuzzer targets are not built (make deps installs clang)"
endif

fuzz: all fuzz-build
	@BUILD=$(BUILD) FUZZ_SECONDS=$(FUZZ_SECONDS) FUZZ_KEEP=1 tests/fuzz/run.sh

$(FUZZ_DIR)/gen_corpus: tests/fuzz/gen_corpus.c tests/fuzz/fuzz.h $(TEST_LINK) $(PROTO_H)
	@mkdir -p $(dir $@)
	@echo "  CC      $@"
	$(Q)$(CC) $(CFLAGS) $(LDFLAGS) -o $@ $< $(TEST_LINK) $(LIBS) $(CUDA_LIBS)

fuzz-corpus: $(FUZZ_DIR)/gen_corpus
	$(FUZZ_DIR)/gen_corpus tests/fuzz/corpus

test: all $(UNIT_BIN) $(ITEST_BIN) $(FUZZ_REPLAY) $(if $(filter-out 0,$(FUZZ_TEST_SECONDS)),fuzz-build)
	@BUILD=$(BUILD) FUZZ_SECONDS=$(FUZZ_TEST_SECONDS) tests/run.sh

run: all
	@BUILD=$(BUILD) tests/demo.sh

bench: all
	@$(MAKE) -C kernels/bench BUILD=$(abspath $(BUILD))

# ---- install, uninstall, deb ----------------------------------------------
# Install paths; DESTDIR is used only in these rules. Units, sysusers.d and
# tmpfiles.d go under PREFIX/lib, where systemd also looks for /usr/local.
BINDIR       ?= $(PREFIX)/bin
SBINDIR      ?= $(PREFIX)/sbin
LIBDIR       ?= $(PREFIX)/lib
INCLUDEDIR   ?= $(PREFIX)/include
PKGCONFIGDIR ?= $(LIBDIR)/pkgconfig
SYSCONFDIR   ?= /etc
UNITDIR      ?= $(PREFIX)/lib/systemd/system
SYSUSERSDIR  ?= $(PREFIX)/lib/sysusers.d
TMPFILESDIR  ?= $(PREFIX)/lib/tmpfiles.d
MANDIR       ?= $(PREFIX)/share/man

INSTALLED := $(SBINDIR)/moed $(BINDIR)/moectl $(LIBDIR)/libmoe.a $(LIBDIR)/libmoe.so.0 \
             $(LIBDIR)/libmoe.so $(INCLUDEDIR)/moe.h $(PKGCONFIGDIR)/libmoe.pc \
             $(UNITDIR)/moed.service $(UNITDIR)/moed.socket $(SYSUSERSDIR)/moed.conf \
             $(TMPFILESDIR)/moed.conf $(MANDIR)/man8/moed.8 $(MANDIR)/man1/moectl.1

# The pkg-config file is written here, not copied from the build, so that it
# names the PREFIX and LIBDIR of this install. An existing moed.conf is kept.
install: all
	install -d $(DESTDIR)$(BINDIR) $(DESTDIR)$(SBINDIR) $(DESTDIR)$(LIBDIR) \
	  $(DESTDIR)$(INCLUDEDIR) $(DESTDIR)$(PKGCONFIGDIR) $(DESTDIR)$(UNITDIR) \
	  $(DESTDIR)$(SYSUSERSDIR) $(DESTDIR)$(TMPFILESDIR) $(DESTDIR)$(SYSCONFDIR)/moed \
	  $(DESTDIR)$(MANDIR)/man1 $(DESTDIR)$(MANDIR)/man8
	install -m 0755 $(BUILD)/moed $(DESTDIR)$(SBINDIR)/moed
	install -m 0755 $(BUILD)/moectl $(DESTDIR)$(BINDIR)/moectl
	install -m 0644 $(BUILD)/libmoe.a $(DESTDIR)$(LIBDIR)/libmoe.a
	install -m 0755 $(BUILD)/libmoe.so $(DESTDIR)$(LIBDIR)/libmoe.so.0
	ln -sf libmoe.so.0 $(DESTDIR)$(LIBDIR)/libmoe.so
	install -m 0644 client/moe.h $(DESTDIR)$(INCLUDEDIR)/moe.h
	sed -e 's|@PREFIX@|$(PREFIX)|g' -e 's|@VERSION@|$(VERSION)|g' \
	  -e 's|^libdir=.*|libdir=$(LIBDIR)|' -e 's|^includedir=.*|includedir=$(INCLUDEDIR)|' \
	  client/libmoe.pc.in > $(DESTDIR)$(PKGCONFIGDIR)/libmoe.pc
	chmod 0644 $(DESTDIR)$(PKGCONFIGDIR)/libmoe.pc
	sed -e 's|@SBINDIR@|$(SBINDIR)|g' -e 's|@SYSCONFDIR@|$(SYSCONFDIR)|g' \
	  packaging/moed.service.in > $(DESTDIR)$(UNITDIR)/moed.service
	chmod 0644 $(DESTDIR)$(UNITDIR)/moed.service
	install -m 0644 packaging/moed.socket $(DESTDIR)$(UNITDIR)/moed.socket
	install -m 0644 packaging/moed.sysusers $(DESTDIR)$(SYSUSERSDIR)/moed.conf
	install -m 0644 packaging/moed.tmpfiles $(DESTDIR)$(TMPFILESDIR)/moed.conf
	test -e $(DESTDIR)$(SYSCONFDIR)/moed/moed.conf || \
	  install -m 0644 packaging/moed.conf $(DESTDIR)$(SYSCONFDIR)/moed/moed.conf
	install -m 0644 packaging/moed.8 $(DESTDIR)$(MANDIR)/man8/moed.8
	install -m 0644 packaging/moectl.1 $(DESTDIR)$(MANDIR)/man1/moectl.1
ifeq ($(DESTDIR),)
	@echo "note: now run: ldconfig; systemd-sysusers moed.conf; systemd-tmpfiles --create moed.conf; systemctl daemon-reload"
endif

# moed.conf goes only if it is still the example.
uninstall:
	rm -f $(addprefix $(DESTDIR),$(INSTALLED))
	if cmp -s packaging/moed.conf $(DESTDIR)$(SYSCONFDIR)/moed/moed.conf; then \
	  rm -f $(DESTDIR)$(SYSCONFDIR)/moed/moed.conf; rmdir $(DESTDIR)$(SYSCONFDIR)/moed 2>/dev/null || true; fi

DEB_VERSION  ?= $(VERSION)-1
DEB_ARCH      = $(shell dpkg --print-architecture)
DEB_MULTIARCH = $(shell dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || $(CC) -print-multiarch)
DEB           = $(BUILD)/moed_$(DEB_VERSION)_$(DEB_ARCH).deb

# Packages what `make` built (CUDA included when it was): installed into a
# staging tree with Debian's paths, then packaging/mkdeb.sh and dpkg-deb.
deb: all
	rm -rf $(BUILD)/deb
	$(MAKE) --no-print-directory install DESTDIR=$(abspath $(BUILD)/deb) PREFIX=/usr \
	  LIBDIR=/usr/lib/$(DEB_MULTIARCH) SYSCONFDIR=/etc
	packaging/mkdeb.sh $(BUILD)/deb $(DEB_VERSION) $(DEB)

.PHONY: uninstall deb

clean:
	rm -rf build build-san

-include $(shell find $(BUILD)/obj $(FUZZ_DIR)/obj -name '*.d' 2>/dev/null)
