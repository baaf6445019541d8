// Command jetbox forwards a PostgreSQL transactional outbox to NATS JetStream.
//
//	jetbox run       stream outbox inserts from the WAL to JetStream
//	jetbox check     check both sides, report every problem at once
//	jetbox repair    make the stream whole from the outbox table (lost slot, backfill)
//	jetbox audit     compare a range of the outbox table with the stream
//	jetbox status    the slot, the publication, the stream and the lag
//	jetbox demo      see it work on a throwaway Postgres and an embedded NATS
//	jetbox healthcheck  exit 0 if a local jetbox answers /healthz
//	jetbox version   print version information
package main

import (
	"context"
	"fmt"
	"github.com/rs/zerolog"
	"io"
	"os"
	"os/signal"
	"syscall"

	"github.com/alecthomas/kong"
)

// Exit codes.
const (
	exitOK      = 0
	exitFailure = 1 // a runtime error jetbox cannot recover from (see the log)
	exitConfig  = 2 // bad flags, bad configuration or a set-up problem to fix
)

// Set at build time: -ldflags "-X main.version=... -X main.commit=...".
var (
	version = "dev"
	commit  = "none"
)

type cli struct {
	Run         RunFlags         `cmd:"" help:"Forward outbox inserts from the WAL to JetStream."`
	Check       checkCmd         `cmd:"" help:"Check both sides and report every problem at once, with fixes (changes nothing)."`
	Repair      repairCmd        `cmd:"" help:"Make the stream whole from the outbox table after a lost slot or on a first deployment (new slot, exported snapshot)."`
	Audit       auditCmd         `cmd:"" help:"Compare a range of the outbox table with the stream: missing, duplicated, out of order (exit 0 complete, 1 found, 2 cannot judge); changes nothing."`
	Status      statusCmd        `cmd:"" help:"One screen: the slot, the publication, the stream and the lag."`
	Demo        demoCmd          `cmd:"" help:"See it work: a throwaway Postgres and an embedded NATS, the forwarder, sample orders, live."`
	Healthcheck healthcheckCmd   `cmd:"" help:"Exit 0 if a local jetbox answers /healthz (for container health checks)."`
	Version     versionCmd       `cmd:"" help:"Print version, commit and Go version."`
	VersionFlag kong.VersionFlag `name:"version" help:"Print version, commit and Go version, and exit."`
}

type versionCmd struct{}

func main() {
	os.Exit(realMain(os.Args[1:], os.Stdout, os.Stderr))
}

func realMain(args []string, stdout, stderr io.Writer) int {
	var c cli
	exitCode := -1
	parser, err := newParser(&c, stdout, stderr, &exitCode)
	if err != nil {
		fmt.Fprintln(stderr, "jetbox:", err)
		return exitFailure
	}
	kctx, code := parseCommand(parser, &exitCode, args, stderr)
	if kctx == nil {
		return code
	}
	switch kctx.Command() {
	case "healthcheck":
		return c.Healthcheck.run()
	case "version":
		fmt.Fprintln(stdout, versionLine())
		return exitOK
	case "check":
		ctx, stop := signalContext()
		defer stop()
		return c.Check.run(ctx, stdout, stderr)
	case "repair":
		ctx, stop := signalContext()
		defer stop()
		return c.Repair.run(ctx, stdout, stderr)
	case "audit":
		ctx, stop := signalContext()
		defer stop()
		return c.Audit.run(ctx, stdout, stderr)
	case "status":
		ctx, stop := signalContext()
		defer stop()
		return c.Status.run(ctx, stdout, stderr)
	case "demo":
		ctx, stop := signalContext()
		defer stop()
		return c.Demo.run(ctx, stdout, stderr)
	case "run":
		cfg, code := runConfig(&c.Run, stderr)
		if code != exitOK {
			return code
		}
		ctx, stop := signalContext()
		defer stop()
		return run(ctx, cfg, stdout, stderr)
	}
	fmt.Fprintln(stderr, "jetbox: unknown command", kctx.Command())
	return exitConfig
}

// newParser returns the command-line parser for c; kong's exit requests
// (--help) are stored in *exitCode instead of exiting.
func newParser(c *cli, stdout, stderr io.Writer, exitCode *int) (*kong.Kong, error) {
	return kong.New(c,
		kong.Name("jetbox"),
		kong.Description("Forward a PostgreSQL transactional outbox to NATS JetStream: every committed row once, in commit order."),
		kong.Writers(stdout, stderr),
		kong.Exit(func(code int) { *exitCode = code }),
		kong.Vars(flagVars),
		kong.Vars{"version": versionLine()},
		kong.ExplicitGroups(flagGroups),
	)
}

// parseCommand parses args (flags and JETBOX_* variables) with a parser from
// newParser. A nil context comes with the exit code: --help, or bad flags
// (reported on stderr).
func parseCommand(parser *kong.Kong, exitCode *int, args []string, stderr io.Writer) (*kong.Context, int) {
	*exitCode = -1
	kctx, err := parser.Parse(args)
	if *exitCode >= 0 { // --help
		return nil, *exitCode
	}
	if err != nil {
		fmt.Fprintf(stderr, "jetbox: %v\nRun 'jetbox --help' for the flags.\n", err)
		return nil, exitConfig
	}
	return kctx, exitOK
}

// runConfig validates the flags of `jetbox run`; on problems it prints them
// all and returns exitConfig.
func runConfig(f *RunFlags, stderr io.Writer) (Config, int) {
	cfg, err := f.Config()
	if err != nil {
		// The log format asked for, unless it is itself a problem.
		printRunProblems(stderr, f.LogFormat == "json", "configuration", err)
		return Config{}, exitConfig
	}
	return cfg, exitOK
}

// problemList returns the joined errors of err, or err alone.
func problemList(err error) []error {
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		return j.Unwrap()
	}
	return []error{err}
}

// printProblems prints each joined error on its own line.
func printProblems(w io.Writer, what string, err error) {
	list := problemList(err)
	fmt.Fprintf(w, "jetbox: %d %s problem(s):\n", len(list), what)
	for _, e := range list {
		fmt.Fprintf(w, "  - %v\n", e)
	}
}

// printRunProblems prints the problems that stop jetbox run in its log
// format: with json one JSON log line per problem and a summary line, so a
// log pipeline reads them like the rest of the log; else as printProblems.
func printRunProblems(w io.Writer, json bool, what string, err error) {
	if !json {
		printProblems(w, what, err)
		return
	}
	log := zerolog.New(w).Hook(logTime{}).With().Str("service", "jetbox").Str("kind", what).Logger()
	list := problemList(err)
	for i, e := range list {
		log.Error().Int("problem", i+1).Int("of", len(list)).Msg(e.Error())
	}
	log.Error().Int("problems", len(list)).Msgf("jetbox: %d %s problem(s); nothing started", len(list), what)
}

// signalContext is cancelled by the first SIGINT or SIGTERM; a second one
// exits at once without waiting for in-flight acks.
func signalContext() (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancel(context.Background())
	ch := make(chan os.Signal, 2)
	done := make(chan struct{})
	signal.Notify(ch, syscall.SIGINT, syscall.SIGTERM)
	go func() {
		select {
		case <-ch:
			cancel()
		case <-done:
			return
		}
		select {
		case <-ch:
			fmt.Fprintln(os.Stderr, "jetbox: second signal, exiting without waiting for in-flight acks")
			os.Exit(exitFailure)
		case <-done:
		}
	}()
	return ctx, func() { signal.Stop(ch); close(done); cancel() }
}
