package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync"
	"time"

	"github.com/cenkalti/backoff/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jetbox-dev/jetbox/decoder"
	"github.com/jetbox-dev/jetbox/replication"
	"github.com/jetbox-dev/jetbox/sink"
	"github.com/nats-io/nats.go"
	"github.com/rs/zerolog"
)

// run is `jetbox run`: preflight both sides, then stream until ctx ends.
func run(ctx context.Context, cfg Config, stdout, stderr io.Writer) int {
	log := newLogger(cfg, stdout)
	log.Info().Str("version", version).Str("slot", cfg.Replication.Slot).Str("stream", cfg.Sink.Stream).
		Str("table", cfg.Replication.Decoder.Schema+"."+cfg.Replication.Decoder.Table).Msg("starting")

	nc, pub, err := preflight(ctx, cfg, log)
	if err != nil {
		if ctx.Err() != nil {
			return exitOK
		}
		printProblems(stderr, "set-up", err)
		log.Error().Err(err).Msg("set-up failed")
		return exitConfig
	}
	defer nc.Close()

	streamer, err := replication.New(cfg.PostgresURL, cfg.Replication, sinkAdapter{pub}, log)
	if err != nil {
		log.Error().Err(err).Msg("start replication")
		return exitConfig
	}
	err = streamer.Run(ctx)
	st := pub.Stats()
	ev := log.Info()
	if err != nil {
		ev = log.Error().Err(err)
		var ie *decoder.InvalidEventError
		if errors.As(err, &ie) {
			ev = ev.Str("event_id", ie.ID).Str("lsn", ie.LSN.String()).Str("hint", ie.Hint)
		}
	}
	ev.Str("confirmed_lsn", streamer.ConfirmedLSN().String()).Uint64("published", st.Published).
		Uint64("duplicates", st.Duplicates).Uint64("publish_errors", st.Errors).Msg("stopped")
	if err != nil {
		fmt.Fprintln(stderr, "jetbox:", err)
		return exitFailure
	}
	return exitOK
}

func newLogger(cfg Config, stdout io.Writer) zerolog.Logger {
	w := stdout
	if cfg.LogConsole {
		w = zerolog.ConsoleWriter{Out: stdout, TimeFormat: time.RFC3339Nano}
	}
	return zerolog.New(w).Level(cfg.LogLevel).With().Timestamp().Str("service", "jetbox").Logger()
}

// sinkAdapter lets *sink.Publisher serve as replication.Sink.
type sinkAdapter struct{ p *sink.Publisher }

func (a sinkAdapter) Open() replication.Session { return a.p.Open() }

// unreachableError marks a preflight failure that may pass by itself (a
// server not up yet); preflight retries those while nothing else is wrong.
type unreachableError struct{ err error }

func (e unreachableError) Error() string { return e.err.Error() }
func (e unreachableError) Unwrap() error { return e.err }

// preflight checks and prepares both sides concurrently and reports every
// problem of both at once. While the only problems are unreachable servers it
// retries with backoff, so jetbox can start before Postgres or NATS.
func preflight(ctx context.Context, cfg Config, log zerolog.Logger) (*nats.Conn, *sink.Publisher, error) {
	bo := backoff.NewExponentialBackOff()
	bo.MaxInterval = 10 * time.Second
	for {
		nc, pub, errs := preflightOnce(ctx, cfg, log)
		if len(errs) == 0 {
			return nc, pub, nil
		}
		if nc != nil {
			nc.Close()
		}
		onlyUnreachable := true
		for _, e := range errs {
			var u unreachableError
			if !errors.As(e, &u) {
				onlyUnreachable = false
			}
		}
		joined := errors.Join(errs...)
		if !onlyUnreachable {
			return nil, nil, joined
		}
		wait := bo.NextBackOff()
		log.Warn().Err(joined).Dur("backoff", wait).Msg("waiting for servers")
		select {
		case <-ctx.Done():
			return nil, nil, ctx.Err()
		case <-time.After(wait):
		}
	}
}

func preflightOnce(ctx context.Context, cfg Config, log zerolog.Logger) (*nats.Conn, *sink.Publisher, []error) {
	var (
		wg      sync.WaitGroup
		pgErrs  []error
		natsErr []error
		nc      *nats.Conn
		pub     *sink.Publisher
	)
	wg.Add(2)
	go func() {
		defer wg.Done()
		sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		err := replication.Setup(sctx, cfg.PostgresURL, cfg.Replication, log)
		var pe *replication.ProblemsError
		switch {
		case errors.As(err, &pe):
			for _, p := range pe.Problems {
				pgErrs = append(pgErrs, fmt.Errorf("postgres: %s", p))
			}
		case err != nil:
			e := fmt.Errorf("postgres: %w; fix: check --postgres-url (host, port, user, password, database) and that Postgres is up", err)
			var pgErr *pgconn.PgError
			if errors.As(err, &pgErr) { // the server answered: wrong password, no such database...
				pgErrs = append(pgErrs, e)
			} else {
				pgErrs = append(pgErrs, unreachableError{e})
			}
		}
	}()
	go func() {
		defer wg.Done()
		var err error
		nc, err = connectNATS(cfg, log)
		if err != nil {
			e := fmt.Errorf("nats: connect to %s: %w; fix: check --nats-url, credentials and that NATS is up", redact(cfg.NatsURL), err)
			if errors.Is(err, nats.ErrNoServers) || strings.Contains(err.Error(), "connection refused") {
				natsErr = append(natsErr, unreachableError{e})
			} else {
				natsErr = append(natsErr, e)
			}
			return
		}
		pub, err = sink.New(nc, cfg.Sink, log)
		if err != nil {
			natsErr = append(natsErr, fmt.Errorf("nats: %w", err))
			return
		}
		sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		if _, err := pub.EnsureStream(sctx); err != nil {
			hint := ""
			if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, nats.ErrNoResponders) {
				hint = "; fix: enable JetStream on the NATS server (nats-server -js)"
			}
			natsErr = append(natsErr, fmt.Errorf("nats: %w%s", err, hint))
		}
	}()
	wg.Wait()
	return nc, pub, append(pgErrs, natsErr...)
}

func connectNATS(cfg Config, log zerolog.Logger) (*nats.Conn, error) {
	nlog := log.With().Str("component", "nats").Logger()
	opts := []nats.Option{
		nats.Name("jetbox"),
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
			nlog.Info().Str("server", c.ConnectedUrlRedacted()).Msg("reconnected to NATS")
		}),
		nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
			nlog.Warn().Err(err).Msg("NATS error")
		}),
	}
	if cfg.NatsCreds != "" {
		opts = append(opts, nats.UserCredentials(cfg.NatsCreds))
	}
	return nats.Connect(cfg.NatsURL, opts...)
}
