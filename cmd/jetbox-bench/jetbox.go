package main

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// deployment is one forwarder set-up with its own database (holding the
// outbox table), slot, stream and subject prefix, so workloads never see each
// other's rows or messages.
type deployment struct {
	db, slot, stream, prefix string
	delivery                 string // jetbox's --delivery
}

// newDeployment names every part after name (a lower-case identifier).
func newDeployment(name, delivery string) deployment {
	return deployment{db: name, slot: name, stream: strings.ToUpper(name), prefix: name, delivery: delivery}
}

// buildJetbox builds ./cmd/jetbox into dir and returns the binary's path.
func buildJetbox(ctx context.Context, dir string) (string, error) {
	bin := filepath.Join(dir, "jetbox")
	cmd := exec.CommandContext(ctx, "go", "build", "-o", bin, "github.com/jetbox-dev/jetbox/cmd/jetbox")
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build ./cmd/jetbox: %w\n%s", err, out)
	}
	return bin, nil
}

// jetboxEnv configures `jetbox run` for deployment d.
func (b *bench) jetboxEnv(d deployment) []string {
	return []string{
		"JETBOX_POSTGRES_URL=" + b.srv.dsn(d.db), "JETBOX_NATS_URL=" + b.srv.natsURL,
		"JETBOX_SLOT=" + d.slot, "JETBOX_PUBLICATION=jetbox", "JETBOX_STREAM=" + d.stream,
		"JETBOX_SUBJECT_PREFIX=" + d.prefix, "JETBOX_DELIVERY=" + d.delivery,
		"JETBOX_HTTP_ADDR=", "JETBOX_LOG_LEVEL=info", "JETBOX_LOG_FORMAT=json",
	}
}

// startJetbox starts `jetbox run` for d; extra env entries override.
func (b *bench) startJetbox(d deployment, extra ...string) (*process, error) {
	return startProcess("jetbox", b.logPath("jetbox-"+d.db), append(b.jetboxEnv(d), extra...), b.jetbox, "run")
}

// stopJetbox stops jetbox with SIGTERM and wants its clean exit (code 0).
func stopJetbox(p *process) error {
	if err := p.stop(30 * time.Second); err != nil {
		return fmt.Errorf("%w; log:\n%s", err, p.logTail(2048))
	}
	return nil
}

// prime creates d's database and runs jetbox once until it streams, so the
// slot, the publication and the stream exist before the load (rows committed
// before the slot existed are not streamed).
func (b *bench) prime(ctx context.Context, d deployment, ddl string) error {
	return b.primeWith(ctx, d, ddl, func() (*process, error) { return b.startJetbox(d) })
}

// primeWith is prime with jetbox started by start.
func (b *bench) primeWith(ctx context.Context, d deployment, ddl string, start func() (*process, error)) error {
	if err := b.srv.createDatabase(ctx, d.db, ddl); err != nil {
		return err
	}
	p, err := start()
	if err != nil {
		return err
	}
	if err := b.waitStreaming(ctx, p, d.slot); err != nil {
		p.kill()
		return err
	}
	return stopJetbox(p)
}

// waitStreaming waits until a walsender streams slot, i.e. jetbox finished
// its start-up.
func (b *bench) waitStreaming(ctx context.Context, p *process, slot string) error {
	conn, err := pgx.Connect(ctx, b.srv.dsn("postgres"))
	if err != nil {
		return fmt.Errorf("connect to postgres: %w", err)
	}
	defer conn.Close(context.Background())
	return b.poll(ctx, p, func() (bool, error) {
		var active bool
		err := conn.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_replication_slots s
			JOIN pg_stat_replication r ON r.pid = s.active_pid WHERE s.slot_name = $1)`, slot).Scan(&active)
		if err != nil {
			return false, fmt.Errorf("read slot %s: %w", slot, err)
		}
		return active, nil
	})
}

// errExited says a forwarder ended while the bench waited on it.
var errExited = errors.New("exited early")

// poll calls cond every 10 ms until it reports done, fails, ctx ends, the
// workload's timeout passes, or p (if not nil) exits.
func (b *bench) poll(ctx context.Context, p *process, cond func() (bool, error)) error {
	ctx, cancel := context.WithTimeout(ctx, b.cfg.Timeout)
	defer cancel()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for {
		done, err := cond()
		if err != nil || done {
			return err
		}
		if p != nil && p.exited() {
			return fmt.Errorf("%s %w (%v); log:\n%s", p.name, errExited, p.waitErr, p.logTail(2048))
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("waiting: %w", ctx.Err())
		case <-tick.C:
		}
	}
}

// logPath returns a new log file path in the work dir for name.
func (b *bench) logPath(name string) string {
	b.logs++
	return filepath.Join(b.dir, fmt.Sprintf("%02d-%s.log", b.logs, name))
}
