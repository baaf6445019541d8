package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"os"
	"runtime/debug"
	"strconv"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jetbox-dev/jetbox/sink/format"

	"github.com/cenkalti/backoff/v5"
	"github.com/jetbox-dev/jetbox/decoder"
	"github.com/jetbox-dev/jetbox/internal/check"
	"github.com/jetbox-dev/jetbox/internal/fault"
	"github.com/jetbox-dev/jetbox/internal/metrics"
	"github.com/jetbox-dev/jetbox/internal/natsembed"
	"github.com/jetbox-dev/jetbox/replication"
	"github.com/jetbox-dev/jetbox/sink"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/rs/zerolog"
)

// memoryLimit is jetbox's default soft memory limit with tracing off
// (GOMEMLIMIT overrides it): a base for the runtime, the decoder and the connections, and twice
// the payload bytes the window may hold (each in flight once as an event,
// once in NATS' buffers); 40 MiB at the default 8 MiB window.
func memoryLimit(maxInFlightBytes int) int64 {
	const base = 24 << 20
	if maxInFlightBytes <= 0 {
		return math.MaxInt64 // no bound on the window: no limit either
	}
	return base + 2*int64(maxInFlightBytes)
}

// run is `jetbox run`: preflight both sides, then stream until ctx ends.
func run(ctx context.Context, cfg Config, stdout, stderr io.Writer) int {
	if os.Getenv("GOGC") == "" {
		// The heap is small and bounded by the window: trade a little memory
		// for fewer GC cycles (measured in docs/performance.md).
		debug.SetGCPercent(200)
	}
	log := newLogger(cfg, stdout)
	logStart(log, cfg)
	cfg.Metrics = newRunMetrics(cfg)
	cfg.Replication.Metrics, cfg.Sink.Metrics = cfg.Metrics, cfg.Metrics
	ops, err := startOps(cfg.HTTPAddr, cfg.Metrics, log)
	if err != nil {
		fmt.Fprintln(stderr, "jetbox:", err)
		return exitConfig
	}
	defer ops.close()
	tp, prop, stopTracing, err := startTracing(ctx, cfg.Metrics, log) // tracing.go
	if err != nil {
		printRunProblems(stderr, !cfg.LogConsole, "tracing", err)
		return exitConfig
	}
	defer stopTracing() // after the last ack: exports the last spans, bounded
	cfg.Sink.TracerProvider, cfg.Sink.Propagator = tp, prop
	cfg.Replication.StampDecoded = tp != nil // spans start at decode
	if os.Getenv("GOMEMLIMIT") == "" && tp == nil {
		// A soft limit for the heap the window holds at most: with large
		// payloads GC works harder instead of the heap growing to three times
		// what is live (docs/performance.md, the payload table). Not with
		// tracing on: the span queue and the exporter's buffers are not
		// bounded by the window.
		debug.SetMemoryLimit(memoryLimit(cfg.Replication.MaxInFlightBytes))
	}

	if cfg.NatsURL == "embedded" {
		srv, err := startEmbeddedNATS(cfg)
		if err != nil {
			fmt.Fprintln(stderr, "jetbox:", err)
			return exitConfig
		}
		defer natsembed.Stop(srv)
		cfg.NatsURL = srv.ClientURL()
		log.Info().Str("url", cfg.NatsURL).Str("store_dir", cfg.NatsStoreDir).Msg("embedded NATS server started")
	}

	if cfg.LostSlot.Repair {
		cfg.Metrics.InitRepairs(repairCauses())
		log.Info().Stringer("margin", cfg.LostSlot.Margin).Msg("--on-lost-slot=repair: a lost slot is repaired from the table by the instance that finds it")
	}
	repairs := newAutoRepairs(cfg, log, stdout, stderr)
	for {
		code, retry := runOnce(ctx, cfg, ops, repairs, log, stderr)
		if !retry {
			return code
		}
		if ops != nil {
			// The run's NATS connection is closed: /healthz must not
			// report it while the next run starts (or stands by for a
			// repair), nor /readyz its stopped streamer.
			ops.nats.Store(nil)
			ops.streamer.Store(nil)
			ops.audit.Store(nil)
			ops.slots.Store(nil)
		}
	}
}

// runOnce is one run from the preflight to the stop: retry says a lost slot
// was repaired (or another instance's repair waited for) and the run
// starts over; else code is the exit code.
func runOnce(ctx context.Context, cfg Config, ops *opsServer, repairs *autoRepairs, log zerolog.Logger, stderr io.Writer) (code int, retry bool) {
	nc, pub, err := preflight(ctx, cfg, log)
	if err != nil {
		if ctx.Err() != nil {
			return exitOK, false
		}
		if code, retry, done := repairLost(ctx, repairs, err, log, stderr); done {
			return code, retry
		}
		printRunProblems(stderr, !cfg.LogConsole, "set-up", err)
		log.Error().Err(err).Msg("set-up failed")
		return exitConfig, false
	}
	defer nc.Close()

	if err := limitDecoder(ctx, &cfg, pub, log); err != nil {
		fmt.Fprintln(stderr, "jetbox:", err)
		return exitFailure, false
	}
	streamer, err := replication.New(cfg.PostgresURL, cfg.Replication, sinkAdapter{p: pub, atomic: cfg.Sink.Delivery.Atomic()}, log)
	if err != nil {
		log.Error().Err(err).Msg("start replication")
		return exitConfig, false
	}
	var audits *auditLoop
	if cfg.Audit.Interval > 0 {
		audits = newAuditLoop(cfg, streamer.Ready, log)
		log.Info().Stringer("interval", cfg.Audit.Interval).Stringer("grace", cfg.Audit.Grace).Msg("auditing the stream against the table continuously while streaming")
	}
	var slots *slotWatch
	if len(cfg.StandbyURLs) > 0 {
		slots = newSlotWatch(cfg, streamer.Ready, func() bool {
			st := streamer.State()
			return st == replication.StateStandby || st == replication.StateStopped
		}, log)
	}
	if ops != nil {
		ops.streamer.Store(streamer)
		ops.nats.Store(pub)
		ops.audit.Store(audits)
		ops.slots.Store(slots)
	}
	if !cfg.Sink.Delivery.Guarded() {
		log.Warn().Msg("--order-guard=false: after a lost publish, later events may be stored before it is republished (out of commit order)")
	}
	err = streamAndAudit(ctx, streamer, pub, audits, slots)
	if ctx.Err() == nil {
		if code, retry, done := repairLost(ctx, repairs, err, log, stderr); done {
			return code, retry
		}
	}
	return runExit(ctx, err, cfg, pub, streamer, ops, log, stderr), false
}

// repairLost hands the error that ended a run to the automatic repairs:
// done says the run ends here (with code, or retry: start over); else the
// error is the run's to report.
func repairLost(ctx context.Context, repairs *autoRepairs, err error, log zerolog.Logger, stderr io.Writer) (code int, retry, done bool) {
	again, rerr := repairs.handle(ctx, err)
	switch {
	case again || ctx.Err() != nil:
		return exitOK, again, true
	case rerr == err:
		return 0, false, false
	}
	log.Error().Err(rerr).Msg("stopped: the automatic repair cannot go on")
	fmt.Fprintln(stderr, "jetbox:", rerr)
	var ie *decoder.InvalidEventError
	if errors.As(rerr, &ie) {
		return exitFailure, false, true // as jetbox repair: fix the row and start again
	}
	return exitConfig, false, true
}

// errNATSClosed stops the streamer when the NATS connection is CLOSED.
var errNATSClosed = errors.New("the NATS connection is closed")

// embedNATS starts the embedded server when cfg names it
// (--nats-url=embedded) and points cfg at it; stop shuts it down.
func embedNATS(cfg *Config) (stop func(), err error) {
	if cfg.NatsURL != "embedded" {
		return func() {}, nil
	}
	srv, err := startEmbeddedNATS(*cfg)
	if err != nil {
		return func() {}, err
	}
	cfg.NatsURL = srv.ClientURL()
	return func() { natsembed.Stop(srv) }, nil
}

// startEmbeddedNATS runs the NATS server inside jetbox (--nats-url=embedded).
func startEmbeddedNATS(cfg Config) (*server.Server, error) {
	host, port, _ := net.SplitHostPort(cfg.NatsListen)
	p, err := strconv.Atoi(port)
	if err != nil {
		return nil, fmt.Errorf("--nats-listen %s: %w", cfg.NatsListen, err)
	}
	srv, err := natsembed.Start(natsembed.Options{Host: host, Port: p, StoreDir: cfg.NatsStoreDir})
	if err != nil {
		return nil, fmt.Errorf("embedded NATS server on %s: %w", cfg.NatsListen, err)
	}
	return srv, nil
}

func newLogger(cfg Config, stdout io.Writer) zerolog.Logger {
	w := stdout
	if cfg.LogConsole {
		w = zerolog.ConsoleWriter{Out: stdout, TimeFormat: time.RFC3339Nano}
	}
	return zerolog.New(w).Level(cfg.LogLevel).Hook(logTime{}).With().Str("service", "jetbox").Logger()
}

// logTime stamps every log line with its time in UTC to the nanosecond
// (RFC 3339), not zerolog's default whole seconds, without changing
// zerolog's package-wide time format.
type logTime struct{}

func (logTime) Run(e *zerolog.Event, _ zerolog.Level, _ string) {
	e.Str(zerolog.TimestampFieldName, time.Now().UTC().Format(time.RFC3339Nano))
}

// sinkAdapter lets *sink.Publisher serve as replication.Sink; with atomic
// set, its sessions publish whole transactions as atomic batches.
type sinkAdapter struct {
	p      *sink.Publisher
	atomic bool
}

// Tip reads the stream's last jetbox message (see replication.TipSource).
func (a sinkAdapter) Tip(ctx context.Context, writer string) (replication.StreamTip, bool, error) {
	t, ok, err := a.p.Tip(ctx, writer)
	return replication.StreamTip{Seq: t.Seq, Origin: t.Origin, CommitLSN: t.CommitLSN, TxIndex: t.TxIndex, ID: t.ID, RowID: t.RowID,
		CommitTime: t.CommitTime, Scheme: t.Scheme, Routing: t.Routing, TxLast: t.TxLast,
		AggregateType: t.AggregateType, AggregateID: t.AggregateID, EventType: t.EventType,
		Stored: t.Stored, RepairSince: t.RepairSince, Subject: t.Subject}, ok, err
}

// Forget abandons the positions of an accepted lost history; the slot's
// replay of it from from is checked message by message (sink.ForgetHistory).
func (a sinkAdapter) Forget(t replication.StreamTip, from pglogrepl.LSN) {
	a.p.ForgetHistory(t.Seq, t.Origin, format.Position{CommitLSN: uint64(from)})
}

func (a sinkAdapter) Open(ctx context.Context, source string) (replication.PublishSession, error) {
	if a.atomic {
		s, err := a.p.OpenAtomic(ctx, source)
		if err != nil {
			return nil, err
		}
		return s, nil
	}
	s, err := a.p.Open(ctx, source)
	if err != nil {
		return nil, err
	}
	return s, nil
}

// preflight runs every check on both sides (see checkAll). While the only
// problems are unreachable servers it retries with backoff, so jetbox can
// start before Postgres or NATS; any other error stops it, listing every
// problem at once. Then it creates what is missing.
func preflight(ctx context.Context, cfg Config, log zerolog.Logger) (*nats.Conn, *sink.Publisher, error) {
	bo := backoff.NewExponentialBackOff()
	bo.MaxInterval = 10 * time.Second
	for {
		r := checkAll(ctx, cfg, log)
		if len(r.unreachable) == 0 && !check.Fatal(r.findings) {
			for _, f := range r.findings {
				if f.Severity == check.Warning {
					log.Warn().Str("check", f.Check).Str("fix", f.Hint).Msg(f.What)
				}
			}
			err := ensureAll(ctx, cfg, r.pub, log)
			if err == nil {
				return r.nc, r.pub, nil
			}
			var he *replication.HistoryError
			if errors.As(err, &he) || fault.Is(err) {
				r.nc.Close()
				return nil, nil, err
			}
			// A server went away between the checks and the creations (or
			// another instance raced us): check everything again.
			r.nc.Close()
			wait := bo.NextBackOff()
			log.Warn().Err(err).Stringer("backoff", wait).Msg("set-up interrupted, checking again")
			select {
			case <-ctx.Done():
				return nil, nil, ctx.Err()
			case <-time.After(wait):
			}
			continue
		}
		if r.nc != nil {
			r.nc.Close()
		}
		errs := r.errors()
		if !check.Fatal(r.findings) && len(r.unreachable) > 0 {
			wait := bo.NextBackOff()
			log.Warn().Err(errors.Join(errs...)).Stringer("backoff", wait).Msg("waiting for servers")
			select {
			case <-ctx.Done():
				return nil, nil, ctx.Err()
			case <-time.After(wait):
			}
			continue
		}
		return nil, nil, errors.Join(errs...)
	}
}

// ensureAll creates what the checks found missing on both sides.
func ensureAll(ctx context.Context, cfg Config, pub *sink.Publisher, log zerolog.Logger) error {
	// On a standby the slot's creation may wait up to --postgres-timeout.
	sctx, cancel := context.WithTimeout(ctx, 30*time.Second+cfg.Replication.Timeout)
	defer cancel()
	// Before a missing slot is created: is this a first start?
	if _, _, err := replication.VerifyHistory(sctx, cfg.PostgresURL, cfg.Replication, sinkAdapter{p: pub}, log); err != nil {
		return err
	}
	if err := replication.Ensure(sctx, cfg.PostgresURL, cfg.Replication, log); err != nil {
		return err
	}
	_, err := pub.EnsureStream(sctx)
	return err
}

// connectNATS connects with cfg's URLs, credentials and TLS; asyncErr (if
// set) also gets the connection's asynchronous errors.
func connectNATS(cfg Config, log zerolog.Logger, asyncErr func(error)) (*nats.Conn, error) {
	nlog := log.With().Str("component", "nats").Logger()
	opts := []nats.Option{
		nats.Name(cfg.NATS.Name),
		nats.MaxReconnects(-1),    // never reach CLOSED: pending acks would hang
		nats.ReconnectBufSize(-1), // publishing while disconnected fails at once
		nats.ReconnectWait(500 * time.Millisecond),
		// Notice a dead (half-open) connection in ~30s, not the default ~4min.
		nats.PingInterval(10 * time.Second),
		nats.MaxPingsOutstanding(3),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			if err != nil { // nil: our own Close
				nlog.Warn().Err(err).Msg("disconnected from NATS")
			}
		}),
		nats.ReconnectHandler(func(c *nats.Conn) {
			cfg.Metrics.Reconnects.WithLabelValues("nats").Inc()
			nlog.Info().Str("server", c.ConnectedUrlRedacted()).Msg("reconnected to NATS")
		}),
		nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
			nlog.Warn().Err(err).Msg("NATS error")
			if asyncErr != nil {
				asyncErr(err)
			}
		}),
	}
	a := cfg.NATS
	switch {
	case a.Creds != "":
		opts = append(opts, nats.UserCredentials(a.Creds))
	case a.NKey != "":
		opt, err := nats.NkeyOptionFromSeed(a.NKey)
		if err != nil {
			return nil, fmt.Errorf("read NKey seed %s: %w", a.NKey, err)
		}
		opts = append(opts, opt)
	case a.User != "":
		opts = append(opts, nats.UserInfo(a.User, a.Password))
	case a.Token != "":
		opts = append(opts, nats.Token(a.Token))
	}
	if a.TLSCA != "" {
		opts = append(opts, nats.RootCAs(a.TLSCA))
	}
	if a.TLSCert != "" {
		opts = append(opts, nats.ClientCert(a.TLSCert, a.TLSKey))
	}
	if a.TLSFirst {
		opts = append(opts, nats.TLSHandshakeFirst())
	}
	if a.UserJWT != "" {
		opts = append(opts, nats.UserJWTAndSeed(a.UserJWT, a.UserSeed))
	}
	if a.InboxPrefix != "" {
		opts = append(opts, nats.CustomInboxPrefix(a.InboxPrefix))
	}
	return nats.Connect(cfg.NatsURL, opts...)
}

// deadLetterNext is the way past a dead-letterable row an exit or a
// repair stopped on (verb: how to go on, "restart" or "run it"), naming
// the dead-letter subject that is configured: --dead-letter-subject when
// set (dead-lettering is on, and this row's dead letter failed too), else
// the default <prefix>._dlq that --on-invalid=dead-letter would use.
func deadLetterNext(cfg Config, code, verb string) string {
	if dl := cfg.Replication.Decoder.DeadLetterSubject; dl != "" {
		return fmt.Sprintf("or fix what refused its dead letter on %s.%s (jetbox runs with --on-invalid=dead-letter: see the error) and %s", dl, code, verb)
	}
	return fmt.Sprintf("or %s with --on-invalid=dead-letter to publish it to %s.%s (or to --dead-letter-subject.%s) and go on", verb, format.DefaultDeadLetterSubject(cfg.Sink.SubjectPrefix), code, code)
}

// logStart logs what this run forwards, and how.
func logStart(log zerolog.Logger, cfg Config) {
	start := log.Info().Str("version", version).Str("delivery", cfg.Sink.Delivery.Flag()).Str("slot", cfg.Replication.Slot).Str("stream", cfg.Sink.Stream)
	if d := cfg.Replication.Decoder; d.Table != "" {
		start = start.Str("table", d.Schema+"."+d.Table)
	}
	if d := cfg.Replication.Decoder; d.MessagePrefix != "" {
		start = start.Str("message_prefix", d.MessagePrefix)
	}
	if t := cfg.Replication.Decoder.Subjects; t != nil {
		start = start.Str("subject_template", t.String()).Int("partitions", t.Partitions())
	}
	start.Msg("starting")
}

// newRunMetrics returns the metrics of a run, every label set it can
// report initialised at 0 (alerts see a series before its first increment).
func newRunMetrics(cfg Config) *metrics.Metrics {
	m := metrics.New()
	m.SetBuild(buildVersion())
	m.DeclareStates(replication.States())
	m.SetState(replication.StateStarting)
	var deadLetter []string
	if cfg.Replication.Decoder.DeadLetterSubject != "" {
		for _, r := range format.Reasons() {
			if (&decoder.InvalidEventError{Code: r}).DeadLetterable() {
				deadLetter = append(deadLetter, r)
			}
		}
	}
	var ignored []string
	if cfg.Replication.Decoder.MessagePrefix != "" || cfg.Replication.HeartbeatInterval > 0 {
		ignored = decoder.IgnoredReasons()
	}
	m.InitLabels(format.Reasons(), deadLetter, ignored)
	return m
}

// limitDecoder gives the decoder the server's and the stream's limits, so a
// row over them is invalid before it is published.
func limitDecoder(ctx context.Context, cfg *Config, pub *sink.Publisher, log zerolog.Logger) error {
	limit, err := pub.MessageLimit(ctx)
	if err != nil {
		log.Error().Err(err).Msg("read the stream's limits")
		return err
	}
	cfg.Replication.Decoder.MaxMessageSize = limit
	cfg.Replication.Decoder.MaxSubjectLength = pub.SubjectLimit()
	cfg.Replication.Decoder.Size = pub.MessageSize
	if dl := cfg.Replication.Decoder.DeadLetterSubject; dl != "" {
		log.Info().Str("subject", dl+".<reason>").Msg("rows that cannot be published become dead letters")
	}
	return nil
}

// streamAndAudit streams until ctx ends or the streamer stops, with the
// continuous audit (audits, nil: none) and the watch of the standbys' slot
// copies (slots, nil: none) beside it. A CLOSED NATS connection
// never comes back (nats.go does not reconnect from it, whatever
// MaxReconnects): it stops the streamer, whether or not a publish is in
// flight to fail on it, with the connection's error.
func streamAndAudit(ctx context.Context, streamer *replication.Streamer, pub *sink.Publisher, audits *auditLoop, slots *slotWatch) error {
	rctx, stop := context.WithCancelCause(ctx)
	defer stop(nil)
	go func() {
		select {
		case <-pub.Closed():
			stop(errNATSClosed)
		case <-rctx.Done():
		}
	}()
	auditDone := make(chan struct{})
	go func() {
		defer close(auditDone)
		if audits != nil {
			audits.run(rctx)
		}
	}()
	slotsDone := make(chan struct{})
	go func() {
		defer close(slotsDone)
		if slots != nil {
			slots.run(rctx)
		}
	}()
	err := streamer.Run(rctx)
	stop(nil)
	<-auditDone
	<-slotsDone
	if errors.Is(context.Cause(rctx), errNATSClosed) && (err == nil || errors.Is(err, context.Canceled)) {
		err = pub.ClosedError()
	}
	return err
}

// runExit logs how the run ended and returns its exit code: 2 for a
// history or settings problem, 1 for any other error, 0 for a stop.
func runExit(ctx context.Context, err error, cfg Config, pub *sink.Publisher, streamer *replication.Streamer, ops *opsServer, log zerolog.Logger, stderr io.Writer) int {
	var he *replication.HistoryError
	if errors.As(err, &he) {
		log.Error().Err(err).Str("case", he.Case).Str("after_commit_time", he.Tip.CommitTime).Str("after_lsn", he.Tip.CommitLSN.String()).Msg("the server does not continue the stream's history")
		fmt.Fprintln(stderr, "jetbox:", err)
		return exitConfig
	}
	var se *replication.SettingsError
	if errors.As(err, &se) {
		log.Error().Err(err).Str("setting", se.Setting).Uint64("tip_seq", se.Tip.Seq).Str("tip_lsn", se.Tip.CommitLSN.String()).Msg("this run's settings break what the stream's last message was stored under")
		printRunProblems(stderr, !cfg.LogConsole, "configuration", err)
		return exitConfig
	}
	st := pub.Stats()
	ev := log.Info()
	next := ""
	var finalScrape <-chan struct{}
	if err != nil {
		ev = log.Error().Err(err)
		var ie *decoder.InvalidEventError
		if errors.As(err, &ie) {
			if ie.DeadLetterable() {
				next = "the slot stays before this row, so nothing after it is lost: fix the cause and restart, " + deadLetterNext(cfg, ie.Code, "restart")
			}
			ev = ev.Str("event_id", ie.ID).Str("lsn", ie.LSN.String()).Str("reason", ie.Code).Str("hint", ie.Hint).Str("next", next)
			count := func() { cfg.Metrics.InvalidRows.WithLabelValues(ie.Code, "stop").Inc() }
			if cfg.FinalScrapeWait > 0 {
				finalScrape = ops.countThenArm(count) // a scrape that has the count ends the wait
			} else {
				count()
			}
		}
	}
	ev.Str("confirmed_lsn", streamer.ConfirmedLSN().String()).Uint64("published", st.Published).
		Uint64("duplicates", st.Duplicates).Uint64("publish_errors", st.Errors).Msg("stopped")
	if err != nil {
		fmt.Fprintln(stderr, "jetbox:", err)
		if next != "" {
			fmt.Fprintln(stderr, "jetbox:", next)
		}
		if finalScrape != nil && cfg.FinalScrapeWait > 0 {
			// A restart stops on the same row: nothing is lost by staying
			// until Prometheus has the count (JetboxInvalidRows).
			log.Info().Stringer("final_scrape_wait", cfg.FinalScrapeWait).Msg("waiting for a scrape of /metrics before exiting")
			scraped := awaitScrape(ctx, finalScrape, cfg.FinalScrapeWait)
			log.Info().Bool("scraped", scraped).Msg("exiting")
		}
		return exitFailure
	}
	return exitOK
}
