# stockade — build, test, demo, install. `make`, `make check`, `make demo`,
# `make SAN=1 check`, `make install`, `make deb`.
CC      ?= cc
PYTHON  := /usr/bin/python3
DEPS    := contrib/deps-debian.sh
# The version is defined once: the top entry of debian/changelog.
VERSION := $(shell head -n1 debian/changelog | cut -d' ' -f2 | tr -d '()')

# pkg-config names; msgpack-c's file is msgpack.pc on Debian 12, msgpack-c.pc on Debian 13
# and Ubuntu 24.04.
have_pc  = $(shell pkg-config --exists $(1) 2>/dev/null && echo $(1))
MSGPACK_PC := $(or $(call have_pc,msgpack-c),$(call have_pc,msgpack),msgpack-c)
PKGS    := lua5.4 lua5.4-cjson $(MSGPACK_PC) libseccomp nettle jansson libhs libpcre2-8 libsystemd
# the Debian package that ships each .pc (and libev's header, which has no .pc)
DEB_OF  := lua5.4=liblua5.4-dev lua5.4-cjson=lua-cjson-dev msgpack=libmsgpack-dev \
           msgpack-c=libmsgpack-c-dev|libmsgpack-dev libseccomp=libseccomp-dev nettle=nettle-dev \
           jansson=libjansson-dev libhs=libvectorscan-dev|libhyperscan-dev libpcre2-8=libpcre2-dev \
           libsystemd=libsystemd-dev ev.h=libev-dev pkg-config=pkg-config
MISSING := $(if $(shell command -v pkg-config),,pkg-config) \
           $(foreach p,$(PKGS),$(if $(call have_pc,$(p)),,$(p))) \
           $(if $(wildcard /usr/include/ev.h /usr/local/include/ev.h),,ev.h)
MISSING := $(strip $(MISSING))

# Install layout (GNU conventions); DESTDIR is prepended at install time only.
PREFIX     ?= /usr/local
BINDIR     ?= $(PREFIX)/bin
DATADIR    ?= $(PREFIX)/share/stockade
MANDIR     ?= $(PREFIX)/share/man
# /etc whatever the prefix: the binary's default policy is /etc/stockade/policy.lua
SYSCONFDIR ?= /etc
PYTHONDIR  ?= $(PREFIX)/lib/python3/dist-packages
SYSTEMD_UNITDIR := $(or $(shell pkg-config --variable=systemdsystemunitdir systemd 2>/dev/null),/lib/systemd/system)
UNITDIR    ?= $(if $(filter /usr,$(PREFIX)),$(SYSTEMD_UNITDIR),$(PREFIX)/lib/systemd/system)
COMPLETIONDIR ?= $(PREFIX)/share/bash-completion/completions

VARIANT := $(if $(SAN),san,rel)
B       := build/$(VARIANT)

WARN    := -Wall -Wextra -Werror -Wshadow -Wstrict-prototypes -Wmissing-prototypes -Wno-unused-parameter
HARDEN  := -fPIE -fstack-protector-strong -D_FORTIFY_SOURCE=2 -fno-strict-aliasing
SANFLAGS := -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer
OPT     := $(if $(SAN),-O1 -g $(SANFLAGS),-O2 -g)
CFLAGS  += -std=c11 -D_GNU_SOURCE $(WARN) $(HARDEN) $(OPT) -Icore -I$(B) \
           $(shell pkg-config --cflags $(PKGS) 2>/dev/null)
LDFLAGS += -pie -Wl,-z,noexecstack -Wl,-z,relro -Wl,-z,now $(if $(SAN),$(SANFLAGS))
# The C libraries are linked in (the -dev packages ship the .a): a dynamic start-up maps
# and relocates each shared library (measured: README, Performance). Shared still: libc;
# jansson (its json_string() and util.h's would collide in a static link). Loaded on first
# use (dlopen, by soname): vectorscan (libhs.a is C++ and not position-independent; only a
# policy with regex redactors needs it, core/hs_lazy.c) and libsystemd (no .a; only serve
# under systemd needs it, core/sd_lazy.c). SAN=1 links the rest dynamically.
DYNAMIC_LIBS := -ljansson
LAZY_LIBS := -lhs -lsystemd
soname = $(or $(shell objdump -p $$($(CC) -print-file-name=$(1)) 2>/dev/null | awk '/SONAME/ {print $$2}'),$(2))
CFLAGS  += -DHS_SONAME='"$(call soname,libhs.so,libhs.so.5)"' \
           -DSD_SONAME='"$(call soname,libsystemd.so,libsystemd.so.0)"'
STATIC_LIBS := $(filter-out $(DYNAMIC_LIBS) $(LAZY_LIBS),$(shell pkg-config --libs $(PKGS) 2>/dev/null)) -lev
LDLIBS  += $(if $(SAN),$(STATIC_LIBS),-Wl,-Bstatic $(STATIC_LIBS) -Wl,-Bdynamic) \
           $(DYNAMIC_LIBS) -ldl -lm -pthread
# ... with Lua's API exported, for the C modules `stockade test` may load (lua-cjson)
LDFLAGS += $(if $(SAN),,-Wl,--export-dynamic-symbol=lua_*,--export-dynamic-symbol=luaL_*)

CORE_SRC := $(filter-out core/main.c,$(wildcard core/*.c))
CORE_OBJ := $(CORE_SRC:core/%.c=$(B)/%.o) $(B)/lua_embed.o
LUA_SRC  := $(wildcard lua/*.lua)
PLUGIN_SRC := $(wildcard plugins/*.lua)
UNIT_SRC := $(wildcard tests/unit/test_*.c)
UNIT_BIN := $(UNIT_SRC:tests/unit/%.c=$(B)/%)

.PHONY: all deps check check-graph check-unit check-lua luacheck check-integration check-mcp \
        check-node demo fuzz clean bench bench-quick build-deps install uninstall man deb FORCE
all: stockade

# A missing build dependency is named in one line, before any compiler error about it.
build-deps:
ifneq ($(MISSING),)
	@echo "stockade: missing build dependencies: $(MISSING) (Debian/Ubuntu packages:$(foreach m,$(MISSING), $(patsubst $(m)=%,%,$(filter $(m)=%,$(DEB_OF))))); run 'make deps' as root" >&2; exit 1
endif

# ./stockade is a copy of the variant just built, so `make SAN=1 check` tests the sanitized one.
stockade: $(B)/stockade FORCE
	@cmp -s $< $@ || { cp $< $@.tmp && mv -f $@.tmp $@; }
FORCE:

$(B)/stockade: $(B)/main.o $(CORE_OBJ)
	@echo "  LD    $@"
	@$(CC) $(LDFLAGS) -o $@ $^ $(LDLIBS)

$(B)/%.o: core/%.c $(wildcard core/*.h) $(B)/version.h | $(B)/.dir build-deps
	@echo "  CC    $<"
	@$(CC) $(CFLAGS) -c -o $@ $<

# The version and the install paths the binary looks in; rewritten only when one of them
# changes, so a rebuild stays incremental.
$(B)/version.h: debian/changelog FORCE | $(B)/.dir
	@{ echo '#define STOCKADE_VERSION "$(VERSION)"'; \
	   echo '#define STOCKADE_DATADIR "$(DATADIR)"'; \
	   echo '#define STOCKADE_PYTHONDIR "$(PYTHONDIR)"'; } > $@.tmp
	@cmp -s $@.tmp $@ && rm -f $@.tmp || mv -f $@.tmp $@

# The bundled Lua (lua/*.lua) and the shipped plugins (plugins/*.lua, as plugins.NAME) are
# compiled into the binary so that a policy always meets the API version the core was
# built with, wherever the policy lives.
# They are precompiled (bytecode with line information) by a helper built against the
# same Lua: a start loads them instead of parsing ~140 KB of source.
$(B)/lua-dump: contrib/lua-dump.c | $(B)/.dir build-deps
	@$(CC) -std=c11 -O2 $(shell pkg-config --cflags lua5.4) -o $@ $< $(shell pkg-config --libs lua5.4) -lm
$(B)/lua_embed.c: $(LUA_SRC) $(PLUGIN_SRC) contrib/embed-lua.sh $(B)/lua-dump | $(B)/.dir
	@sh contrib/embed-lua.sh $(B)/lua-dump $(LUA_SRC) $(PLUGIN_SRC) > $@.tmp && mv -f $@.tmp $@
$(B)/lua_embed.o: $(B)/lua_embed.c
	@$(CC) $(CFLAGS) -c -o $@ $<

$(B)/test_%: tests/unit/test_%.c tests/unit/check.h $(CORE_OBJ)
	@echo "  LD    $@"
	@$(CC) $(CFLAGS) -Itests/unit $(LDFLAGS) -o $@ $< $(CORE_OBJ) $(LDLIBS)

# test_session makes the random source fail.
$(B)/test_session: LDFLAGS += -Wl,--wrap=getrandom

$(B)/.dir:
	@mkdir -p $(B) && touch $@

deps:
	@sh $(DEPS)

check: deps
	@$(MAKE) --no-print-directory all $(UNIT_BIN)
	@$(MAKE) --no-print-directory check-graph check-unit check-lua check-integration check-mcp check-node

# The core's modules form no cycle (contrib/include-graph.sh --print shows the graph).
check-graph:
	@sh contrib/include-graph.sh core

check-unit: $(UNIT_BIN)
	@set -e; for t in $(UNIT_BIN); do echo "== $$t"; $$t; done

# LuaUnit suites: the bundled modules, every plugin, every shipped policy. Fixtures in
# tests/fixtures find the plugins through STOCKADE_PLUGIN_PATH.
LUA_TESTS := $(wildcard tests/lua/test_*.lua plugins/tests/test_*.lua policies/tests/test_*.lua)
# luacheck with .luacheckrc: policies, plugins, the bundled Lua, the tests
luacheck:
	@luacheck --no-color -q lua policies plugins tests/lua tests/fixtures contrib/luals

check-lua: stockade luacheck
	@set -e; for t in $(LUA_TESTS); do echo "== $$t"; \
	    STOCKADE_PLUGIN_PATH=$(CURDIR)/plugins:$(CURDIR)/tests/fixtures/plugins ./stockade test $$t; done

# Two runs: each directory has its own conftest.py.
PYTEST := STOCKADE_BIN=$(CURDIR)/stockade STOCKADE_SANITIZED=$(SAN) PYTHONPATH=contrib/python \
          $(PYTHON) -m pytest -q -p no:cacheprovider
check-integration: stockade
	$(PYTEST) tests/integration
	$(PYTEST) tests/security
	$(PYTEST) tests/redact

# `stockade mcp` against the official MCP SDK client (pinned by tests/mcp/package-lock.json).
tests/mcp/node_modules/.installed: tests/mcp/package.json tests/mcp/package-lock.json
	cd tests/mcp && npm ci --no-audit --no-fund --loglevel=error
	@touch $@
check-mcp: stockade tests/mcp/node_modules/.installed
	cd tests/mcp && STOCKADE_BIN=$(CURDIR)/stockade node --test

# contrib/node: the TypeScript/Node client's tests and the npm interop test, with the
# packages of its lock file (npm ci, again only when the lock file changed).
NODE_DIR := contrib/node
$(NODE_DIR)/node_modules/.stamp: $(NODE_DIR)/package-lock.json $(NODE_DIR)/package.json
	cd $(NODE_DIR) && npm ci --no-audit --no-fund --loglevel=error
	@touch $@
check-node: stockade $(NODE_DIR)/node_modules/.stamp
	cd $(NODE_DIR) && STOCKADE_BIN=$(CURDIR)/stockade node --test test/*.test.js

# libFuzzer over the decoder and dispatcher of `serve`, spawning stubbed.
FUZZ_SECONDS ?= 60
FZ       := build/fuzz
FZ_FLAGS := -std=c11 -D_GNU_SOURCE -O1 -g -fno-omit-frame-pointer -Icore -I$(FZ) \
            $(shell pkg-config --cflags $(PKGS) 2>/dev/null) \
            -fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=all
FZ_OBJ   := $(CORE_SRC:core/%.c=$(FZ)/%.o) $(FZ)/lua_embed.o
$(FZ)/%.o: core/%.c $(wildcard core/*.h) $(FZ)/version.h | $(FZ)/.dir
	clang $(FZ_FLAGS) -c -o $@ $<
$(FZ)/version.h: $(B)/version.h | $(FZ)/.dir
	cp $< $@
$(FZ)/lua_embed.c: $(LUA_SRC) $(PLUGIN_SRC) contrib/embed-lua.sh $(B)/lua-dump | $(FZ)/.dir
	sh contrib/embed-lua.sh $(B)/lua-dump $(LUA_SRC) $(PLUGIN_SRC) > $@.tmp && mv -f $@.tmp $@
$(FZ)/lua_embed.o: $(FZ)/lua_embed.c
	clang $(FZ_FLAGS) -c -o $@ $<
# fuzz_rpc, and fuzz_mcp over `stockade mcp`'s JSON-RPC decoder and dispatcher, the same
# way: both on the server of tests/fuzz/fuzz_server.c.
$(FZ)/fuzz_rpc $(FZ)/fuzz_mcp: $(FZ)/fuzz_%: tests/fuzz/fuzz_%.c tests/fuzz/fuzz_server.c tests/fuzz/fuzz_server.h tests/fuzz/spawn_stub.c $(FZ_OBJ)
	clang $(FZ_FLAGS) -fsanitize=fuzzer -Wl,--wrap=spawn_start,--wrap=zygote_start,--wrap=zygote_start_begin \
	    -o $@ $(filter %.c %.o,$^) $(shell pkg-config --libs $(PKGS) 2>/dev/null) -lev -lm -pthread
$(FZ)/.dir:
	@mkdir -p $(FZ) && touch $@
fuzz: deps
	@sh $(DEPS) --with-clang
	@$(MAKE) --no-print-directory $(FZ)/fuzz_rpc $(FZ)/fuzz_mcp
	@mkdir -p $(FZ)/corpus && cp -n tests/fuzz/corpus/* $(FZ)/corpus/ 2>/dev/null || true
	$(FZ)/fuzz_rpc -max_total_time=$(FUZZ_SECONDS) -max_len=65536 -timeout=10 \
	    -print_final_stats=1 $(FZ)/corpus
	@mkdir -p $(FZ)/corpus_mcp && cp -n tests/fuzz/corpus_mcp/* $(FZ)/corpus_mcp/ 2>/dev/null || true
	$(FZ)/fuzz_mcp -max_total_time=$(FUZZ_SECONDS) -max_len=65536 -timeout=10 \
	    -print_final_stats=1 $(FZ)/corpus_mcp

# The benchmark (tests/bench/run.py): one table, medians with p25-p75, ratios to baselines
# measured in the same run. BENCH_ARGS="--json FILE" keeps every figure.
bench: deps
	@$(MAKE) --no-print-directory all
	$(PYTHON) tests/bench/run.py $(BENCH_ARGS)
bench-quick: deps
	@$(MAKE) --no-print-directory all
	$(PYTHON) tests/bench/run.py --quick $(BENCH_ARGS)

demo: deps
	@$(MAKE) --no-print-directory all
	@PYTHONPATH=contrib/python STOCKADE_BIN=$(CURDIR)/stockade $(PYTHON) contrib/demo.py

clean:
	rm -rf build stockade $(NODE_DIR)/node_modules $(NODE_DIR)/build

# ---- install -------------------------------------------------------------------------
# `make install PREFIX=/usr/local DESTDIR=`: the binary, the shipped plugins, example
# policies under /etc/stockade/ (an existing file is never overwritten: policy.lua is the
# operator's), man pages, systemd units, bash completion, the Python client and the soak
# driver. `make uninstall` removes them again, and an /etc file only if unchanged.
MAN_SRC  := $(wildcard man/*.scd)
MAN_OUT  := $(MAN_SRC:man/%.scd=build/man/%)
PY_CLIENT := $(wildcard contrib/python/stockade_client/*.py)
PY_SOAK   := $(wildcard contrib/soak/stockade_soak/*.py)
ETC_EXAMPLES := $(wildcard policies/*.lua)
INSTALL  ?= install
# the units name the binary by its installed path
UNIT_SED := sed -e 's|/usr/bin/stockade|$(BINDIR)/stockade|g'

man: $(MAN_OUT)
build/man/%: man/%.scd
	@mkdir -p build/man
	@command -v scdoc >/dev/null || { echo "stockade: scdoc is missing (Debian package: scdoc)" >&2; exit 1; }
	scdoc < $< > $@

install: stockade man
	$(INSTALL) -d $(DESTDIR)$(BINDIR) $(DESTDIR)$(DATADIR)/plugins \
	    $(DESTDIR)$(SYSCONFDIR)/stockade $(DESTDIR)$(UNITDIR) $(DESTDIR)$(COMPLETIONDIR) \
	    $(DESTDIR)$(PYTHONDIR)/stockade_client $(DESTDIR)$(PYTHONDIR)/stockade_soak \
	    $(foreach s,1 5 7,$(DESTDIR)$(MANDIR)/man$(s))
	$(INSTALL) -m 0755 $(B)/stockade $(DESTDIR)$(BINDIR)/stockade
	$(INSTALL) -m 0644 $(PLUGIN_SRC) $(DESTDIR)$(DATADIR)/plugins/
	@set -e; new() { if [ -e "$$2" ]; then echo "  KEEP  $$2 (exists)"; \
	    else $(INSTALL) -D -m 0644 "$$1" "$$2"; echo "  NEW   $$2"; fi; }; \
	for f in $(ETC_EXAMPLES); do new $$f $(DESTDIR)$(SYSCONFDIR)/stockade/$$(basename $$f); done; \
	new policies/default.lua $(DESTDIR)$(SYSCONFDIR)/stockade/policy.lua; \
	new contrib/systemd/stockade.default $(DESTDIR)$(SYSCONFDIR)/default/stockade; \
	new contrib/systemd/stockade.logrotate $(DESTDIR)$(SYSCONFDIR)/logrotate.d/stockade
	for u in stockade.service stockade.socket; do \
	    $(UNIT_SED) contrib/systemd/$$u > $(DESTDIR)$(UNITDIR)/$$u.tmp && \
	    chmod 0644 $(DESTDIR)$(UNITDIR)/$$u.tmp && mv -f $(DESTDIR)$(UNITDIR)/$$u.tmp $(DESTDIR)$(UNITDIR)/$$u; done
	$(INSTALL) -m 0644 contrib/completion/stockade.bash $(DESTDIR)$(COMPLETIONDIR)/stockade
	$(INSTALL) -m 0644 $(PY_CLIENT) $(DESTDIR)$(PYTHONDIR)/stockade_client/
	$(INSTALL) -m 0644 $(PY_SOAK) $(DESTDIR)$(PYTHONDIR)/stockade_soak/
	$(foreach m,$(MAN_OUT),$(INSTALL) -m 0644 $(m) $(DESTDIR)$(MANDIR)/man$(subst .,,$(suffix $(m)))/;)

uninstall:
	rm -f $(DESTDIR)$(BINDIR)/stockade $(DESTDIR)$(COMPLETIONDIR)/stockade \
	    $(DESTDIR)$(UNITDIR)/stockade.service $(DESTDIR)$(UNITDIR)/stockade.socket \
	    $(foreach m,$(MAN_SRC:man/%.scd=%),$(DESTDIR)$(MANDIR)/man$(subst .,,$(suffix $(m)))/$(m))
	rm -rf $(DESTDIR)$(DATADIR) $(DESTDIR)$(PYTHONDIR)/stockade_client \
	    $(DESTDIR)$(PYTHONDIR)/stockade_soak
	@same() { if cmp -s "$$1" "$$2"; then rm -f "$$2"; \
	    elif [ -e "$$2" ]; then echo "  KEEP  $$2 (changed)"; fi; }; \
	for f in $(ETC_EXAMPLES); do same $$f $(DESTDIR)$(SYSCONFDIR)/stockade/$$(basename $$f); done; \
	same policies/default.lua $(DESTDIR)$(SYSCONFDIR)/stockade/policy.lua; \
	same contrib/systemd/stockade.default $(DESTDIR)$(SYSCONFDIR)/default/stockade; \
	same contrib/systemd/stockade.logrotate $(DESTDIR)$(SYSCONFDIR)/logrotate.d/stockade
	@rmdir $(DESTDIR)$(SYSCONFDIR)/stockade 2>/dev/null || true

# ---- Debian package ------------------------------------------------------------------
# `make deb`: build/deb/stockade_VERSION_ARCH.deb with debhelper from debian/, built in a
# copy of the tree (dpkg-buildpackage writes beside the source), then checked by lintian
# (errors fail the target).
DEB_ARCH := $(shell dpkg --print-architecture 2>/dev/null)
DEB      := build/deb/stockade_$(VERSION)_$(DEB_ARCH).deb
deb:
	@sh $(DEPS) --with-deb
	@command -v dpkg-buildpackage >/dev/null && command -v dh >/dev/null || \
	    { echo "stockade: make deb needs dpkg-dev and debhelper (run 'make deps' as root)" >&2; exit 1; }
	rm -rf build/deb && mkdir -p build/deb/stockade-$(VERSION)
	tar -c --exclude=./build --exclude=./.git --exclude=./stockade --exclude=__pycache__ \
	    --exclude=node_modules . | \
	    tar -x -C build/deb/stockade-$(VERSION)
	cd build/deb/stockade-$(VERSION) && dpkg-buildpackage -us -uc -b -j2 >../build.log 2>&1 || \
	    { tail -40 ../build.log; exit 1; }
	lintian --fail-on error $(DEB)
	@echo "  DEB   $(DEB)"
