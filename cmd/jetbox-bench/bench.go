package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	"github.com/rs/zerolog"
)

// bench is one benchmark run: its settings, work directory and servers.
type bench struct {
	cfg    Config
	log    zerolog.Logger
	dir    string
	srv    *servers
	jetbox string // the binary measured
	self   string // this binary, for the child roles
	logs   int    // log files made so far
	floors int    // floor clients started so far (their slots' names)
	// floorConfirm: the floor client confirms what it receives (see
	// floorClient); cfg.FloorConfirm, or per set-up in compare.
	floorConfirm bool
}

// Report is everything one run measured.
type Report struct {
	Header []string // the machine, versions and settings

	Dedup, ExactlyOnce, Recv, Relay *throughput // catch-up
	RawID, RawHeaders, RawGuarded   *throughput // raw JetStream publishing
	RawStream                       *throughput // RawGuarded + Nats-Expected-Stream
	FastBatch                       *throughput
	BigTx                           *throughput
	Sweeps                          []*sweep // jetbox's steady state and knee search, per set-up (dedup first)
	RelaySteady, RawSteady          *latencyRun
	Startups                        []time.Duration // warm-slot start-ups, after the dedup sweep
	StartErr                        error
	Profiled                        *throughput
	Traced                          *throughput // --trace
	ProfilePath                     string      // dedup
	ProfiledExactly                 *throughput
	ProfilePathExactly              string
	ProfileErr                      error
	Scale                           []scaleRun    // --scale
	Compare                         []*compareRun // --baseline-bin, --status-intervals
	CompareErr                      error
	Workload                        []*workloadRun // --workload
	cfg                             Config
}

// Run runs every workload and returns the report. An error means the run
// could not be set up or was interrupted; a workload's own failure is in its
// part of the report (see Report.Failed).
func Run(ctx context.Context, cfg Config, log zerolog.Logger) (*Report, error) {
	b := &bench{cfg: cfg, log: log, floorConfirm: cfg.FloorConfirm}
	cleanup, err := b.setUp(ctx)
	defer cleanup()
	if err != nil {
		return nil, err
	}
	rep := &Report{cfg: cfg, Header: b.header()}
	b.runAll(ctx, rep)
	return rep, ctx.Err()
}

// setUp makes the work dir, the jetbox binary and the servers; cleanup
// undoes whatever was done, also after an error.
func (b *bench) setUp(ctx context.Context) (cleanup func(), err error) {
	var undo []func()
	cleanup = func() {
		for i := len(undo) - 1; i >= 0; i-- {
			undo[i]()
		}
	}
	if b.dir = b.cfg.WorkDir; b.dir == "" {
		if b.dir, err = os.MkdirTemp("", "jetbox-bench-"); err != nil {
			return cleanup, fmt.Errorf("make work dir: %w", err)
		}
	} else if err = os.MkdirAll(b.dir, 0o755); err != nil {
		return cleanup, fmt.Errorf("make work dir: %w", err)
	}
	dir := b.dir
	switch {
	case b.cfg.Keep:
		undo = append(undo, func() { b.log.Info().Str("dir", dir).Msg("kept the work dir") })
	case b.cfg.Profile:
		undo = append(undo, func() {
			_ = os.RemoveAll(filepath.Join(dir, "nats")) // server data: large, of no use afterwards
			b.log.Info().Str("dir", dir).Msg("kept the logs and the profile")
		})
	default:
		undo = append(undo, func() { _ = os.RemoveAll(dir) })
	}
	if b.self, err = os.Executable(); err != nil {
		return cleanup, fmt.Errorf("find own binary: %w", err)
	}
	if b.jetbox = b.cfg.JetboxBin; b.jetbox == "" {
		b.log.Info().Msg("building jetbox")
		if b.jetbox, err = buildJetbox(ctx, b.dir); err != nil {
			return cleanup, err
		}
	}
	if b.srv, err = startServers(ctx, b.cfg, b.dir, b.log); err != nil {
		return cleanup, err
	}
	undo = append(undo, b.srv.close)
	return cleanup, nil
}

// runAll runs the workloads in turn; each records its result in rep.
func (b *bench) runAll(ctx context.Context, rep *Report) {
	c := b.cfg
	step := func(name, w string, fn func()) {
		switch {
		case !c.runs(w):
		case ctx.Err() == nil:
			fn()
		default:
			b.log.Warn().Str("workload", name).Msg("skipped: interrupted")
		}
	}
	var endLSN string
	step("catch-up dedup", "dedup", func() {
		rep.Dedup, endLSN = b.jetboxCatchup(ctx, "jetbox, --delivery=dedup", newDeployment("catchup", "dedup"),
			c.Rows, c.TxRows, catchupOpts{recvSlot: "recv"})
	})
	step("pg_recvlogical", "recv", func() {
		if rep.Dedup != nil {
			rep.Recv = b.recvlogical(ctx, newDeployment("catchup", ""), "recv", endLSN, c.Rows)
		}
	})
	step("catch-up exactly-once", "exactly-once", func() {
		rep.ExactlyOnce, _ = b.jetboxCatchup(ctx, "jetbox, --delivery=exactly-once", newDeployment("exactly", "exactly-once"),
			c.Rows, c.TxRows, catchupOpts{})
	})
	if c.Trace { // beside the other catch-ups, to compare with them
		step("traced catch-up", "exactly-once", func() { rep.Traced = b.tracedCatchup(ctx) })
	}
	step("polling relay", "relay", func() { rep.Relay = b.relayCatchup(ctx, c.Rows, c.TxRows) })
	step("raw publish", "raw", func() {
		rep.RawID = b.rawPublish(ctx, "raw async JetStream publish, Nats-Msg-Id only", "RAW", c.Rows, idOnly)
	})
	step("raw publish, jetbox headers", "raw", func() {
		rep.RawHeaders = b.rawPublish(ctx, "raw async JetStream publish, + jetbox's Jetbox-* headers", "RAWHDR", c.Rows, jetboxHeaders)
	})
	step("raw publish, jetbox headers and guards", "raw", func() {
		rep.RawGuarded = b.rawPublish(ctx, "raw async JetStream publish, + Jetbox-* headers and order guard (what jetbox sends, exactly-once)",
			"RAWGUARD", c.Rows, jetboxGuarded)
	})
	step("raw publish, + expected stream", "raw", func() {
		rep.RawStream = b.rawPublish(ctx, "raw async JetStream publish, those + Nats-Expected-Stream (what jetbox sent before)",
			"RAWSTREAM", c.Rows, guardedStream)
	})
	step("fast batch", "fast-batch", func() { rep.FastBatch = b.fastBatch(ctx, c.Rows) })
	for i, su := range steadySetups {
		step("steady "+su.name, su.workload, func() {
			rep.Sweeps = append(rep.Sweeps, b.jetboxSweep(ctx, rep, su.name, su.db, su.delivery, su.env, i == 0))
		})
	}
	step("steady relay", "steady", func() {
		if rep.Relay != nil && rep.Relay.Err == nil {
			rep.RelaySteady = b.relaySteady(ctx)
		}
	})
	step("raw steady", "steady", func() { rep.RawSteady = b.rawSteady(ctx) })
	if c.BigTx > 0 {
		step("big transaction", "big-tx", func() { rep.BigTx = b.bigTx(ctx, c.BigTx) })
	}
	step("profile", "profile", func() {
		rep.Profiled, rep.ProfilePath, rep.ProfileErr = b.profiledCatchup(ctx, "dedup")
		if rep.ProfileErr == nil {
			rep.ProfiledExactly, rep.ProfilePathExactly, rep.ProfileErr = b.profiledCatchup(ctx, "exactly-once")
		}
	})
	step("compare", "compare", func() { rep.Compare, rep.CompareErr = b.compare(ctx) })
	step("workload", workloadName, func() { b.runWorkload(ctx, rep) })
	b.runScale(ctx, rep)
}

// header describes the machine and the run.
func (b *bench) header() []string {
	c := b.cfg
	natsVersion := b.srv.nc.ConnectedServerVersion()
	jetboxVersion := "?"
	if out, err := runOutput(b.jetbox, "version"); err == nil {
		jetboxVersion = strings.TrimSpace(out)
	}
	h := []string{
		fmt.Sprintf("%s; %d CPUs (%s); PostgreSQL %s (fsync=on, synchronous_commit=on); nats-server %s (file storage, R1); %s",
			time.Now().UTC().Format("2006-01-02 15:04 UTC"), runtime.NumCPU(), cpuModel(), b.srv.pgVersion, natsVersion, jetboxVersion),
		fmt.Sprintf("catch-up: %s rows in %d-row transactions, %d-byte JSON payloads; steady: %s at %d rows/s in 1-row transactions, %d writers; knee steps of %s",
			groupDigits(float64(c.Rows)), c.TxRows, c.PayloadSize, c.Steady, c.SteadyRate, c.Writers, c.Step),
	}
	if c.CPUs.on() {
		h = append(h, c.CPUs.describe())
	}
	if c.runs(workloadName) {
		h = append(h, b.workloadHeader())
	}
	return h
}

// cpuModel names the processor, from /proc/cpuinfo.
func cpuModel() string {
	b, err := os.ReadFile("/proc/cpuinfo")
	if err != nil {
		return "unknown CPU"
	}
	for _, line := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "model name" {
			return strings.TrimSpace(v)
		}
	}
	return "unknown CPU"
}
