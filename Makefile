# Entry points. `make train` installs what is missing, builds, and trains the default GPT on the
# King James Bible; `make test` builds and runs every test (also under ASan+UBSan).
BUILD ?= build
BUILD_SAN ?= build-asan
BUILD_TSAN ?= build-tsan
# The sanitizer builds compile at -O1 -g1: about half the compile time of -O2 -g, their reports
# still name every frame's file and line, and the suite runs near -O2's speed (at -Og it took 8x
# as long under ASan).
SAN_FLAGS = -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" \
  -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG"
JOBS ?= $(shell nproc)
KUAI = $(BUILD)/kuai
# A line with the time as each phase of a build or a test run starts and ends (CI's time budget).
STAMP = @date '+[%T] $(1)'

# The threaded parts (loader workers, metric logger, trainer, tokenizer cache) run again under
# ThreadSanitizer (kuai_tsan_tests: the files that hold these suites).
# The multi-rank tests whose leaks are checked under ASan (the test target says why only these).
MPI_LEAK_DDP = MpiGroup.*:MpiDDP.*:MpiZero.Stage2*:MpiTrainer.CompiledStepsEqualEagerBitForBit
MPI_LEAK_ZERO3 = MpiZero3.CompressedReduceScatterEqualsCompressedDdp:MpiZero3.FineTunes*
MPI_LEAK_RESUME = MpiZero3.ResumeOfATwoRankZero3RunIsBitExact
MPI_LEAK_TESTS = $(MPI_LEAK_DDP):$(MPI_LEAK_ZERO3):$(MPI_LEAK_RESUME)
TSAN_TESTS = DataLoader*:RandomWindows*:SequentialWindows*:SyntheticTokens*:MetricRing*:Trainer*:Checkpoint*:HfTokenizer.EncodesOnSeveralThreadsAtOnce

.PHONY: setup build build-asan build-tsan train test test-fast bench bench-peer golden clean format

setup:
	@scripts/setup.sh

build: setup
	$(call STAMP,build: Release)
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release >/dev/null
	@cmake --build $(BUILD) -j $(JOBS)
	$(call STAMP,build: Release done)

build-asan: setup
	$(call STAMP,build: ASan+UBSan)
	@cmake -S . -B $(BUILD_SAN) $(SAN_FLAGS) -DKUAI_SANITIZE=address,undefined >/dev/null
	@cmake --build $(BUILD_SAN) -j $(JOBS) --target kuai_tests
	@if grep -q '^KUAI_MPIRUN:FILEPATH=/' $(BUILD_SAN)/CMakeCache.txt; then \
	  cmake --build $(BUILD_SAN) -j $(JOBS) --target kuai_mpi_tests; fi
	$(call STAMP,build: ASan+UBSan done)

build-tsan: setup
	$(call STAMP,build: TSan)
	@cmake -S . -B $(BUILD_TSAN) $(SAN_FLAGS) -DKUAI_SANITIZE=thread >/dev/null
	@cmake --build $(BUILD_TSAN) -j $(JOBS) --target kuai_tsan_tests
	$(call STAMP,build: TSan done)

train: build
	$(KUAI) train --config configs/kjv.toml

test-fast: build
	cd $(BUILD) && ctest --output-on-failure -j 1

test: build build-asan build-tsan
	$(call STAMP,test: the suite (Release))
	cd $(BUILD) && ctest --output-on-failure -j 1
	$(call STAMP,test: the suite under ASan+UBSan)
	cd $(BUILD_SAN) && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
	  OMP_NUM_THREADS=2 ./kuai_tests --gtest_brief=1
# The multi-rank tests under ASan+UBSan too, 2 ranks, in two runs. Every test runs without the
# leak check: OpenMPI's own allocations can be told apart only by full unwinding on every malloc,
# which made that run 10x as long (6.2 min on 2 cores; 1.3 min with fast unwinding). The leak check
# then runs on the tests of kuai's own collectives, DDP, ZeRO-2 and ZeRO-3 (compression, resume,
# compiled steps, Hugging Face files), with full unwinding and OpenMPI's allocations suppressed
# (tests/mpi/lsan.supp: matched by any frame of the stack). A leak outside MPI is still reported.
	$(call STAMP,test: the multi-rank suite under ASan+UBSan)
	if [ -x $(BUILD_SAN)/kuai_mpi_tests ]; then cd $(BUILD_SAN) && \
	  ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1 \
	  mpirun --allow-run-as-root --oversubscribe -np 2 -x ASAN_OPTIONS -x UBSAN_OPTIONS \
	    -x OMP_NUM_THREADS=1 ./kuai_mpi_tests --gtest_brief=1 && \
	  ASAN_OPTIONS=detect_leaks=1:fast_unwind_on_malloc=0 UBSAN_OPTIONS=print_stacktrace=1 \
	  LSAN_OPTIONS=suppressions=$(CURDIR)/tests/mpi/lsan.supp:print_suppressions=0 \
	  mpirun --allow-run-as-root --oversubscribe -np 2 -x ASAN_OPTIONS -x UBSAN_OPTIONS \
	    -x LSAN_OPTIONS -x OMP_NUM_THREADS=1 ./kuai_mpi_tests --gtest_brief=1 \
	    --gtest_filter='$(MPI_LEAK_TESTS)'; fi
	$(call STAMP,test: the threaded suites under TSan)
	cd $(BUILD_TSAN) && TSAN_OPTIONS=halt_on_error=1 OMP_NUM_THREADS=1 \
	  ./kuai_tsan_tests --gtest_brief=1 --gtest_filter='$(TSAN_TESTS)'
	$(call STAMP,test: fuzzing)
	@$(MAKE) --no-print-directory fuzz
	$(call STAMP,test: done)

# Fuzzing (clang-14 libFuzzer + ASan + UBSan): the three parsers of untrusted input, the
# safetensors reader (kuai_fuzz_safetensors: every input is rejected with an error naming the
# file, or accepted with its promised invariants), the TOML run config (kuai_fuzz_config:
# no crash, and an accepted config round-trips through to_toml) and the tokenizer.json reader with
# the text it encodes (kuai_fuzz_tokenizer: ids inside the vocabulary, byte-level round trips,
# prefix-stable decoding). Builds only those targets in $(BUILD_FUZZ), then runs them side by
# side for FUZZ_SECONDS each from scratch copies of
# fuzz/corpus/*; a crash, sanitizer report, leak or hang fails (input kept in
# $(BUILD_FUZZ)/fuzz-artifacts/).
BUILD_FUZZ ?= build-fuzz
FUZZ_SECONDS ?= 60
.PHONY: fuzz
fuzz: setup
	@CC=clang-14 CXX=clang++-14 cmake -S . -B $(BUILD_FUZZ) -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DKUAI_FUZZ=ON >/dev/null
	@cmake --build $(BUILD_FUZZ) -j $(JOBS) --target kuai_fuzz_safetensors kuai_fuzz_config \
	  kuai_fuzz_tokenizer
	@fuzz/run_fuzzers.sh $(BUILD_FUZZ) $(FUZZ_SECONDS)

bench: build
	$(KUAI) bench machine --threads=2
	$(KUAI) bench --all
	$(KUAI) bench attention
	$(KUAI) bench ddp
	@if [ -x $(BUILD)/kuai_bench_ops ]; then $(BUILD)/kuai_bench_ops --benchmark_min_time=0.2; fi

bench-peer: build
	/usr/bin/python3 bench/peer_compare.py --kuai $(KUAI)

golden:
	/usr/bin/python3 tests/golden/make_golden.py

format:
	clang-format -i $$(git ls-files '*.cpp' '*.h')

clean:
	rm -rf $(BUILD) $(BUILD_SAN) $(BUILD_TSAN) $(BUILD_FUZZ)
