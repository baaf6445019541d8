package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jetbox-dev/jetbox/internal/check"
	"github.com/jetbox-dev/jetbox/replication"
	"github.com/jetbox-dev/jetbox/sink"
	"github.com/nats-io/nats.go"
	"github.com/rs/zerolog"
)

// checkResult is everything one pass of checks found on both sides.
type checkResult struct {
	findings    []check.Finding
	unreachable []error // servers that did not answer at all
	nc          *nats.Conn
	pub         *sink.Publisher
}

// errors returns every fatal finding and unreachable server as errors.
func (r checkResult) errors() []error {
	var errs []error
	for _, f := range r.findings {
		if f.Severity == check.Error {
			errs = append(errs, fmt.Errorf("%s: %s; fix: %s", f.Check, f.What, f.Hint))
		}
	}
	return append(errs, r.unreachable...)
}

// checkAll checks Postgres and NATS concurrently, changing nothing. The NATS
// connection it opens is returned for the caller to use or close.
func checkAll(ctx context.Context, cfg Config, log zerolog.Logger) checkResult {
	var (
		wg           sync.WaitGroup
		pg, ns       []check.Finding
		pgErr, nsErr error
		r            checkResult
	)
	wg.Add(2)
	go func() {
		defer wg.Done()
		pg, pgErr = replication.Check(ctx, cfg.PostgresURL, cfg.Replication, log)
	}()
	go func() {
		defer wg.Done()
		var pubRef atomic.Pointer[sink.Publisher]
		nc, err := connectNATS(cfg, log, func(err error) {
			if p := pubRef.Load(); p != nil {
				p.NoteAsyncError(err)
			}
		})
		if err != nil {
			nsErr = err
			return
		}
		pub, err := sink.New(nc, cfg.Sink, log)
		if err != nil {
			nc.Close()
			nsErr = err
			return
		}
		pubRef.Store(pub)
		sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		ns = pub.Check(sctx, cfg.MaxOutage)
		r.nc, r.pub = nc, pub
	}()
	wg.Wait()
	if pgErr != nil {
		e := fmt.Errorf("postgres: %w; fix: check --postgres-url (host, port, user, password, database) and that Postgres is up", pgErr)
		if errors.Is(pgErr, replication.ErrUnreachable) {
			r.unreachable = append(r.unreachable, e)
		} else {
			pg = append(pg, check.Finding{Severity: check.Error, Check: "postgres.connect", What: redact(pgErr.Error()),
				Hint: "check --postgres-url: user, password, database, sslmode"})
		}
	}
	if nsErr != nil {
		what := fmt.Sprintf("connect to %s: %v", redact(cfg.NatsURL), nsErr)
		if natsUnreachable(nsErr) {
			r.unreachable = append(r.unreachable, fmt.Errorf("nats: %s; fix: check --nats-url and that NATS is up", what))
		} else {
			ns = append(ns, check.Finding{Severity: check.Error, Check: "nats.connect", What: what,
				Hint: "check --nats-url (or --nats-context) and the credentials (--nats-creds, --nats-nkey, --nats-user/--nats-password, --nats-token) and TLS files"})
		}
	}
	r.findings = append(pg, ns...)
	return r
}

// natsUnreachable tells a server that is down or behind a closing proxy or
// load balancer (retry) from a refusal: bad credentials or TLS (stop).
func natsUnreachable(err error) bool {
	var ne net.Error
	return errors.Is(err, nats.ErrNoServers) || errors.Is(err, nats.ErrTimeout) || errors.Is(err, io.EOF) ||
		errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ECONNRESET) ||
		(errors.As(err, &ne) && ne.Timeout()) || strings.Contains(err.Error(), "connection refused")
}

// checkCmd is `jetbox check`: every problem of both sides in one run.
type checkCmd struct {
	RunFlags
	JSON bool `name:"json" help:"Print the findings as JSON."`
}

func (c *checkCmd) run(ctx context.Context, stdout, stderr io.Writer) int {
	cfg, err := c.RunFlags.Config()
	if err != nil {
		printProblems(stderr, "configuration", err)
		return exitConfig
	}
	r := checkAll(ctx, cfg, zerolog.Nop())
	if r.nc != nil {
		r.nc.Close()
	}
	for _, e := range r.unreachable {
		side, _, _ := strings.Cut(e.Error(), ":")
		r.findings = append(r.findings, check.Finding{Severity: check.Error, Check: side + ".connect", What: e.Error()})
	}
	r.findings = append(r.findings, standbyFindings(ctx, cfg)...) // slotsync.go
	fatal := check.Fatal(r.findings)
	if c.JSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		_ = enc.Encode(struct {
			OK       bool            `json:"ok"`
			Findings []check.Finding `json:"findings"`
		}{!fatal, r.findings})
	} else {
		for _, f := range r.findings {
			fmt.Fprintf(stdout, "%-8s %-32s %s\n", strings.ToUpper(string(f.Severity)), f.Check, f.What)
			if f.Hint != "" {
				fmt.Fprintf(stdout, "%-8s %-32s fix: %s\n", "", "", f.Hint)
			}
		}
		n := 0
		for _, f := range r.findings {
			if f.Severity == check.Error {
				n++
			}
		}
		if fatal {
			fmt.Fprintf(stdout, "\n%d problem(s) to fix before jetbox can run.\n", n)
		} else {
			fmt.Fprintln(stdout, "\nready: jetbox run can start (it creates what is marked CREATE).")
		}
	}
	if fatal {
		return exitConfig
	}
	return exitOK
}
