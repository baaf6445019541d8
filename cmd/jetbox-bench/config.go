package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Config is one benchmark run. The defaults are the full-size run of the
// benchmark in docs/performance.md; smaller values make a quick smoke run.
type Config struct {
	JetboxBin     string // the jetbox binary; empty: built from ./cmd/jetbox
	NATSBin       string // a nats-server binary; empty: the embedded server in a child process
	WorkDir       string // empty: a new temp dir, removed at the end
	DropCaches    bool   // --drop-caches: the clean page cache is dropped before every timed run (root)
	Keep          bool   // keep WorkDir whole (logs, profiles, the NATS store); with Profile alone the NATS store goes
	Rows          int    // catch-up rows
	TxRows        int    // rows per catch-up transaction
	PayloadSize   int    // bytes of each JSON payload
	BigTx         int    // rows of the single big transaction; 0 skips it
	Steady        time.Duration
	SteadyRate    int           // rows/s of the steady runs (1-row transactions)
	Rates         []int         // knee search: rates stepped through after the steady run
	Step          time.Duration // duration of each knee step and of the raw publish→consumer run
	KneeP99       time.Duration // a knee step passes while its p99 stays at or below this
	Writers       int           // producer connections
	Starts        int           // warm-slot start-ups measured
	RelayBatch    int
	RelayPoll     time.Duration
	Window        int           // in-flight window of the raw async publish
	Profile       bool          // extra, profiled jetbox catch-ups, one per delivery mode (needs jetbox --pprof-addr)
	Trace         bool          // an extra jetbox catch-up with tracing on (every event sampled)
	Only          []string      // run only these workloads (see workloads); empty: all but the scaling ones
	Scale         bool          // also the scaling workloads (scale.go)
	ScaleRows     []int         // scale-rows: backlog sizes
	ScalePayloads []int         // scale-payload: payload bytes
	ScaleTx       []int         // scale-tx: rows per transaction
	ScaleBytes    int64         // scale-payload: payload bytes per point at most (fewer rows for large payloads)
	Timeout       time.Duration // bound on each wait for a workload to finish
	CPUs          cpuPlan       // --pin-postgres: Postgres on CPUs of its own; zero: no pinning
	// The compare workload (compare.go).
	BaselineBins    []string        // previous jetbox builds run beside the current one (the first is the reference)
	Reps            int             // interleaved repetitions of each set-up
	CompareDelivery []string        // delivery modes compared
	StatusIntervals []time.Duration // the current build at these --status-interval values
	FloorConfirm    bool            // the floor client confirms what it received (flush = write), every second
	FloorBoth       bool            // compare: each set-up twice, the floor confirming and not
	CompareBare     bool            // compare: also the bare forwarder (bare.go), the reference of the hop to JetStream
	// The workload others can compare (workload.go).
	WorkloadSizes []int         // payload bytes per row, one set of steps each
	WorkloadRates []int         // rows (ops) per second, stepped through until one is not sustained
	WorkloadStep  time.Duration // duration of each step
	WorkloadTx    int           // rows per transaction
	WorkloadMode  string        // jetbox's --delivery
}

// defaultConfig is the full-size run.
func defaultConfig() Config {
	return Config{
		Rows: 200_000, TxRows: 100, PayloadSize: 300, BigTx: 1_000_000,
		Steady: 20 * time.Second, SteadyRate: 2000, Rates: []int{4000, 8000, 16000, 32000},
		Step: 5 * time.Second, KneeP99: 10 * time.Millisecond, Writers: 16, Starts: 3,
		RelayBatch: 500, RelayPoll: 100 * time.Millisecond, Window: 1024, Timeout: 5 * time.Minute,
		ScaleRows: []int{200_000, 2_000_000, 10_000_000}, ScalePayloads: []int{100, 1024, 16 << 10, 256 << 10},
		ScaleTx: []int{1, 100, 10_000, 1_000_000}, ScaleBytes: 512 << 20,
		Reps: 3, CompareDelivery: []string{"dedup"}, FloorConfirm: true,
		WorkloadSizes: []int{100, 200, 400, 1600}, WorkloadRates: []int{5000, 10000, 20000, 40000},
		WorkloadStep: 10 * time.Second, WorkloadTx: 100, WorkloadMode: "exactly-once",
	}
}

// parseFlags reads the command line into a Config.
func parseFlags(args []string, stderr io.Writer) (Config, error) {
	c := defaultConfig()
	fs := flag.NewFlagSet("jetbox-bench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintf(stderr, "Usage: go run ./cmd/jetbox-bench [flags]\n\n"+
			"Starts its own PostgreSQL and NATS server, runs jetbox, a polling relay and the raw limits\n"+
			"(pg_recvlogical, async JetStream publish) side by side, checks every run's output and prints\n"+
			"a markdown table. Quick smoke run: --rows 20000 --big-tx 0 --steady 3s --rates 4000 --step 2s\n\nFlags:\n")
		fs.PrintDefaults()
	}
	rates := joinInts(c.Rates)
	scaleRows, scalePayloads, scaleTx := joinInts(c.ScaleRows), joinInts(c.ScalePayloads), joinInts(c.ScaleTx)
	fs.StringVar(&c.JetboxBin, "jetbox", "", "jetbox binary to measure (default: go build ./cmd/jetbox)")
	fs.StringVar(&c.NATSBin, "nats-bin", "", "nats-server binary (default: the embedded server, in a child process)")
	fs.StringVar(&c.WorkDir, "work-dir", "", "directory for server data, logs and profiles (default: a temp dir, removed at the end)")
	fs.BoolVar(&c.Keep, "keep", false, "keep the work directory, the NATS store included")
	fs.IntVar(&c.Rows, "rows", c.Rows, "catch-up rows")
	fs.IntVar(&c.TxRows, "tx-rows", c.TxRows, "rows per catch-up transaction")
	fs.IntVar(&c.PayloadSize, "payload", c.PayloadSize, "JSON payload bytes per row")
	fs.IntVar(&c.BigTx, "big-tx", c.BigTx, "rows of one big transaction for the memory check (0 skips it)")
	fs.DurationVar(&c.Steady, "steady", c.Steady, "duration of the steady-state runs")
	fs.IntVar(&c.SteadyRate, "rate", c.SteadyRate, "rows/s of the steady-state runs (1-row transactions)")
	fs.StringVar(&rates, "rates", rates, "knee search: further rates (rows/s), comma-separated, stepped through after the steady run; empty skips it")
	fs.DurationVar(&c.Step, "step", c.Step, "duration of each knee step and of the raw publish→consumer run")
	fs.DurationVar(&c.KneeP99, "knee-p99", c.KneeP99, "a knee step passes while the achieved rate keeps up and p99 stays at or below this")
	fs.IntVar(&c.Writers, "writers", c.Writers, "producer connections of the steady runs")
	fs.IntVar(&c.Starts, "starts", c.Starts, "warm-slot start-ups to time")
	fs.IntVar(&c.RelayBatch, "relay-batch", c.RelayBatch, "polling relay: rows per round")
	fs.DurationVar(&c.RelayPoll, "relay-poll", c.RelayPoll, "polling relay: pause after an empty round")
	fs.IntVar(&c.Window, "window", c.Window, "raw async publish: messages in flight")
	fs.BoolVar(&c.Profile, "profile", false, "also profile jetbox (CPU, pprof) in an extra catch-up; the profile and the logs stay in the work dir")
	fs.BoolVar(&c.Trace, "trace", false, "also a catch-up with OpenTelemetry tracing on (every event sampled, OTLP/HTTP to a receiver in the bench), to compare with the exactly-once catch-up")
	fs.DurationVar(&c.Timeout, "timeout", c.Timeout, "give up on a workload that has not finished within this")
	fs.BoolVar(&c.Scale, "scale", false, "also the scaling workloads ("+strings.Join(scaleWorkloads, ",")+"): catch-ups by backlog, payload and transaction size; long, and up to ~6 GB of disk")
	fs.StringVar(&scaleRows, "scale-rows", scaleRows, "scale-rows: backlog sizes (rows)")
	fs.StringVar(&scalePayloads, "scale-payloads", scalePayloads, "scale-payload: payload sizes (bytes)")
	fs.StringVar(&scaleTx, "scale-tx", scaleTx, "scale-tx: rows per transaction (each point has max(--rows, this) rows)")
	fs.Int64Var(&c.ScaleBytes, "scale-bytes", c.ScaleBytes, "scale-payload: payload bytes per point at most (min(--rows, this/size) rows)")
	fs.BoolVar(&c.DropCaches, "drop-caches", false, "drop the host's clean page cache before every timed run (needs root; affects the whole host), so that each writes into memory the host used moments before: a diagnostic of what the memory costs (docs/performance.md); every run then reads its WAL back from disk")
	pinPostgres := ""
	fs.StringVar(&pinPostgres, "pin-postgres", "", "run Postgres (every process it forks) on these CPUs, e.g. 0, and NATS, the forwarders and the bench on the others: a database with cores of its own, on one host")
	baselines := ""
	fs.StringVar(&baselines, "baseline-bin", "", "previous jetbox build(s) to run beside the current one, comma-separated (workload compare: steady state at --rate for --steady, --reps interleaved repetitions each, the ratios to the first); alone it runs only compare")
	fs.IntVar(&c.Reps, "reps", c.Reps, "compare: interleaved repetitions of each set-up")
	compareDelivery := strings.Join(c.CompareDelivery, ",")
	fs.StringVar(&compareDelivery, "compare-delivery", compareDelivery, "compare: delivery modes, comma-separated (dedup, exactly-once)")
	statusIntervals := ""
	fs.StringVar(&statusIntervals, "status-intervals", "", "compare: run the current build at each of these --status-interval values (comma-separated durations), compared with the first (or with the baseline); alone it runs only compare")
	floorConfirm := "true"
	fs.StringVar(&floorConfirm, "floor-confirm", floorConfirm, "true: the floor client confirms what it received every second (flush position = write position, as jetbox confirms); false: it reports its write position only; both (compare): each set-up twice, with the floor confirming and not")
	fs.BoolVar(&c.CompareBare, "compare-bare", false, "compare: also run the bare forwarder (pglogrepl → async JetStream publish with Nats-Msg-Id, nothing else), and the same with exactly-once's expected-sequence and -id headers, as set-ups of their own, beside the floor like the others: what any forwarder to JetStream adds to the floor; alone it runs only compare, with the current build")
	workload := false
	fs.BoolVar(&workload, "workload", false, "the workload others can compare, the shape of Sequin's published CDC benchmark: for each --workload-sizes, jetbox then the polling relay "+
		"at each of --workload-rates (transactions of --workload-tx rows, --workload-step each) until a rate is not sustained; mean/p50/p99/p99.9 to stored; alone it runs only this")
	wlSizes, wlRates := joinInts(c.WorkloadSizes), joinInts(c.WorkloadRates)
	fs.StringVar(&wlSizes, "workload-sizes", wlSizes, "workload: row (payload) sizes in bytes, comma-separated")
	fs.StringVar(&wlRates, "workload-rates", wlRates, "workload: rates in rows (ops) per second, comma-separated, ascending")
	fs.DurationVar(&c.WorkloadStep, "workload-step", c.WorkloadStep, "workload: duration of each rate step")
	fs.IntVar(&c.WorkloadTx, "workload-tx", c.WorkloadTx, "workload: rows per transaction")
	fs.StringVar(&c.WorkloadMode, "workload-delivery", c.WorkloadMode, "workload: jetbox's --delivery (exactly-once, dedup)")
	only := ""
	fs.StringVar(&only, "only", "", "run only these workloads, comma-separated, of: "+strings.Join(append(slices.Clone(workloads), scaleWorkloads...), ",")+" (recv needs dedup; default: all but the scale-* ones, which --scale adds)")
	if err := fs.Parse(args); err != nil {
		return Config{}, err
	}
	if fs.NArg() > 0 {
		return Config{}, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	for _, w := range strings.Split(only, ",") {
		if w = strings.TrimSpace(w); w != "" {
			c.Only = append(c.Only, w)
			c.Profile = c.Profile || w == "profile"
		}
	}
	var errs []error
	if pinPostgres != "" {
		allowed, err := allowedCPUs()
		if err == nil {
			c.CPUs, err = parseCPUPlan(pinPostgres, allowed)
		}
		if err != nil {
			errs = append(errs, err)
		}
	}
	c.CompareDelivery = splitList(compareDelivery)
	c.BaselineBins = splitList(baselines)
	switch floorConfirm {
	case "true":
	case "false":
		c.FloorConfirm = false
	case "both":
		c.FloorBoth = true
	default:
		errs = append(errs, fmt.Errorf("--floor-confirm: %q is not true, false or both", floorConfirm))
	}
	for _, f := range strings.Split(statusIntervals, ",") {
		if f = strings.TrimSpace(f); f == "" {
			continue
		}
		d, err := time.ParseDuration(f)
		if err != nil || d <= 0 {
			errs = append(errs, fmt.Errorf("--status-intervals: %q is not a positive duration (e.g. 100ms,1s,10s)", f))
			continue
		}
		c.StatusIntervals = append(c.StatusIntervals, d)
	}
	if len(c.Only) == 0 && (len(c.BaselineBins) > 0 || len(c.StatusIntervals) > 0 || c.CompareBare) {
		c.Only = []string{"compare"}
	}
	if workload && !slices.Contains(c.Only, workloadName) {
		c.Only = append(c.Only, workloadName)
	}
	for _, l := range []struct {
		flag string
		s    string
		v    *[]int
	}{{"workload-sizes", wlSizes, &c.WorkloadSizes}, {"workload-rates", wlRates, &c.WorkloadRates}, {"rates", rates, &c.Rates}, {"scale-rows", scaleRows, &c.ScaleRows}, {"scale-payloads", scalePayloads, &c.ScalePayloads}, {"scale-tx", scaleTx, &c.ScaleTx}} {
		var err error
		if *l.v, err = parseInts(l.s); err != nil {
			errs = append(errs, fmt.Errorf("--%s: %w", l.flag, err))
		}
	}
	if len(errs) > 0 {
		return Config{}, errors.Join(append(errs, c.validate())...)
	}
	return c, c.validate()
}

// validate reports every out-of-range setting at once.
func (c Config) validate() error {
	var errs []error
	positive := func(name string, v int) {
		if v < 1 {
			errs = append(errs, fmt.Errorf("--%s must be at least 1", name))
		}
	}
	positive("rows", c.Rows)
	positive("tx-rows", c.TxRows)
	positive("rate", c.SteadyRate)
	positive("writers", c.Writers)
	positive("relay-batch", c.RelayBatch)
	positive("window", c.Window)
	if c.PayloadSize < 64 {
		errs = append(errs, errors.New("--payload must be at least 64 bytes (the steady runs put a timestamp in it)"))
	}
	if c.BigTx < 0 || c.Starts < 0 {
		errs = append(errs, errors.New("--big-tx and --starts must not be negative"))
	}
	if c.ScaleBytes < 1 {
		errs = append(errs, errors.New("--scale-bytes must be at least 1"))
	}
	for _, p := range c.ScalePayloads {
		if p < 64 || p > 512<<10 {
			errs = append(errs, fmt.Errorf("--scale-payloads: %d is not within 64 bytes and 512 KiB (a number and padding; NATS' max_payload is 1 MiB)", p))
		}
	}
	if c.Steady < time.Second || c.Step < time.Second {
		errs = append(errs, errors.New("--steady and --step must be at least 1s"))
	}
	if c.Reps < 1 {
		errs = append(errs, errors.New("--reps must be at least 1"))
	}
	for _, m := range c.CompareDelivery {
		if m != "dedup" && m != "exactly-once" {
			errs = append(errs, fmt.Errorf("--compare-delivery: %q is not dedup or exactly-once", m))
		}
	}
	errs = append(errs, c.validateWorkload()...)
	if slices.Contains(c.Only, "compare") && len(c.BaselineBins) == 0 && len(c.StatusIntervals) == 0 && !c.CompareBare {
		errs = append(errs, errors.New("--only compare needs --baseline-bin, --status-intervals or --compare-bare (what to compare)"))
	}
	for _, w := range c.Only {
		if !slices.Contains(workloads, w) && !slices.Contains(scaleWorkloads, w) {
			errs = append(errs, fmt.Errorf("--only: unknown workload %q (one of %s)", w, strings.Join(append(slices.Clone(workloads), scaleWorkloads...), ",")))
		}
	}
	return errors.Join(errs...)
}

// workloads are the names --only takes, in the order they run.
var workloads = []string{"dedup", "recv", "exactly-once", "relay", "raw", "fast-batch", "steady", "steady-exactly", "steady-atomic", "big-tx", "profile", "compare", workloadName}

// runs reports whether workload w is to run.
func (c Config) runs(w string) bool {
	switch {
	case w == "profile":
		return c.Profile
	case w == "compare" || w == workloadName:
		return slices.Contains(c.Only, w)
	case slices.Contains(scaleWorkloads, w):
		return c.Scale || slices.Contains(c.Only, w)
	}
	return len(c.Only) == 0 || slices.Contains(c.Only, w)
}

func parseInts(s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f == "" {
			continue
		}
		n, err := strconv.Atoi(f)
		if err != nil || n < 1 {
			return nil, fmt.Errorf("%q is not a positive number", f)
		}
		out = append(out, n)
	}
	return out, nil
}

func joinInts(v []int) string {
	s := make([]string, len(v))
	for i, n := range v {
		s[i] = strconv.Itoa(n)
	}
	return strings.Join(s, ",")
}

// splitList splits a comma-separated list, dropping empty and repeated items.
func splitList(s string) []string {
	var out []string
	for _, m := range strings.Split(s, ",") {
		if m = strings.TrimSpace(m); m != "" && !slices.Contains(out, m) {
			out = append(out, m)
		}
	}
	return out
}
