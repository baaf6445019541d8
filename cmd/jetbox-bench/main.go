// Command jetbox-bench is jetbox's reproducible benchmark. It starts its own
// PostgreSQL (fsync on) and NATS server (JetStream, file storage, in a child
// process so its CPU can be read apart), builds and runs the jetbox binary,
// and measures side by side, in one run:
//
//   - catch-up: a backlog committed after the slot was created, drained by
//     jetbox (--delivery=dedup and exactly-once), by a polling relay written
//     for the comparison, and by the raw limits: pg_recvlogical (pgoutput to
//     /dev/null) over the same WAL and async JetStream publishing of the same
//     number of same-size messages (plus, for the report, fast-ingest batches);
//   - steady state: 1-row transactions at a fixed rate, INSERT → consumer
//     latency for jetbox and the relay, then higher rates until jetbox no
//     longer keeps up (the knee); start-up time on a warm slot; peak RSS on
//     one big transaction.
//
// Every run's output is checked (each committed id in the stream exactly once,
// in commit order for jetbox); a failed check makes the exit code 1. The
// result is a markdown report on stdout: the measurements, and the runs set
// side by side as ratios (the goals they are read against are prose in
// docs/performance.md); progress goes to stderr.
//
//	go run ./cmd/jetbox-bench                  # the full run (a few minutes)
//	go run ./cmd/jetbox-bench --rows 20000 --big-tx 0 --steady 3s --rates 4000 --step 2s
//	go run ./cmd/jetbox-bench --baseline-bin /tmp/jetbox-old --reps 3   # a previous build beside this one (compare.go)
//	go run ./cmd/jetbox-bench --workload      # the workload others can compare, jetbox beside the polling relay (workload.go)
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	"github.com/rs/zerolog"
)

// Exit codes.
const (
	exitOK     = 0
	exitFailed = 1 // a check failed, a workload failed, or the run was interrupted
	exitUsage  = 2
)

func main() {
	if role := os.Getenv(roleEnv); role != "" {
		os.Exit(runChild(role, os.Args[1:], os.Stderr))
	}
	os.Exit(realMain(os.Args[1:], os.Stdout, os.Stderr))
}

func realMain(args []string, stdout, stderr io.Writer) int {
	cfg, err := parseFlags(args, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return exitOK
	}
	if err != nil {
		fmt.Fprintln(stderr, "jetbox-bench:", err)
		return exitUsage
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	go func() { <-ctx.Done(); stop() }() // a second Ctrl-C kills at once; children die with us (Pdeathsig)
	log := zerolog.New(zerolog.ConsoleWriter{Out: stderr, TimeFormat: "15:04:05"}).With().Timestamp().Logger()
	rep, err := Run(ctx, cfg, log)
	if rep != nil {
		rep.Print(stdout)
	}
	switch {
	case err != nil:
		log.Error().Err(err).Msg("benchmark did not complete")
		return exitFailed
	case rep.Failed():
		log.Error().Msg("a run failed or its output was wrong: see the check column")
		return exitFailed
	}
	return exitOK
}
