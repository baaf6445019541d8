package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jetbox-dev/jetbox/internal/pgcluster"
	"github.com/jetbox-dev/jetbox/internal/wait"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"
)

// pgSettings are the server settings of the machine profile: durable
// commits, as in production.
var pgSettings = []string{"fsync=on", "synchronous_commit=on", "max_connections=100"}

// servers are the Postgres cluster and the NATS server every workload shares,
// plus the bench's own client connection to NATS.
type servers struct {
	pg        *pgcluster.Cluster
	pgBin     string
	pgPID     int // the postmaster
	pgVersion string
	nats      *process
	natsStore string // the NATS server's store_dir
	natsURL   string
	nc        *nats.Conn
	js        jetstream.JetStream
	log       zerolog.Logger
}

// startServers starts Postgres and NATS with their data under dir. On error
// whatever was started is stopped again.
func startServers(ctx context.Context, cfg Config, dir string, log zerolog.Logger) (s *servers, err error) {
	s = &servers{log: log}
	defer func() {
		if err != nil {
			s.close()
		}
	}()
	if err := cfg.CPUs.pinSelf(); err != nil { // NATS and every forwarder inherit it
		return nil, err
	}
	if s.pgBin, err = pgcluster.FindBinDir(); err != nil {
		return nil, err
	}
	if _, err := os.Stat(filepath.Join(s.pgBin, "pg_recvlogical")); err != nil {
		return nil, fmt.Errorf("pg_recvlogical not found beside initdb in %s: install the PostgreSQL client programs", s.pgBin)
	}
	if err := s.startPostgres(ctx); err != nil {
		return nil, err
	}
	if err := cfg.CPUs.pinPostgres(s.pgPID); err != nil {
		return nil, err
	}
	log.Info().Str("version", s.pgVersion).Str("dsn", s.pg.DSN).Msg("postgres started")
	if err := s.startNATS(ctx, cfg.NATSBin, dir); err != nil {
		return nil, err
	}
	log.Info().Str("version", s.nc.ConnectedServerVersion()).Str("url", s.natsURL).Msg("nats server started")
	return s, nil
}

// startPostgres initialises and starts the cluster.
func (s *servers) startPostgres(ctx context.Context) error {
	c, err := pgcluster.New(pgcluster.Options{BinDir: s.pgBin, Settings: pgSettings})
	if err != nil {
		return err
	}
	s.pg = c
	sctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	if err := c.Start(sctx); err != nil {
		return err
	}
	if s.pgPID, err = postmasterPID(c.DataDir()); err != nil {
		return err
	}
	conn, err := pgx.Connect(sctx, c.DSN)
	if err != nil {
		return fmt.Errorf("connect to postgres: %w", err)
	}
	defer conn.Close(context.Background())
	return conn.QueryRow(sctx, "SHOW server_version").Scan(&s.pgVersion)
}

// startNATS runs the NATS server as a child process: the bench's own binary
// in its NATS role, or the nats-server binary bin.
func (s *servers) startNATS(ctx context.Context, bin, dir string) error {
	addr, err := freeAddr()
	if err != nil {
		return err
	}
	store := filepath.Join(dir, "nats")
	if err := os.MkdirAll(store, 0o755); err != nil {
		return fmt.Errorf("create nats store: %w", err)
	}
	s.natsStore = store
	logPath := filepath.Join(dir, "nats.log")
	if bin != "" {
		conf := filepath.Join(dir, "nats.conf")
		text := fmt.Sprintf("listen: %s\njetstream { store_dir: %q }\n", addr, store)
		if err := os.WriteFile(conf, []byte(text), 0o600); err != nil {
			return fmt.Errorf("write nats config: %w", err)
		}
		s.nats, err = startProcess("nats-server", logPath, nil, bin, "-c", conf)
	} else {
		self, serr := os.Executable()
		if serr != nil {
			return fmt.Errorf("find own binary to run the nats server: %w", serr)
		}
		s.nats, err = startProcess("nats-server", logPath, []string{roleEnv + "=" + roleNATS}, self,
			"-listen", addr, "-store", store)
	}
	if err != nil {
		return err
	}
	s.natsURL = "nats://" + addr
	return s.connectNATS(ctx)
}

// connectNATS waits until the NATS server serves JetStream and connects.
func (s *servers) connectNATS(ctx context.Context) error {
	deadline := time.Now().Add(30 * time.Second)
	for {
		nc, err := nats.Connect(s.natsURL, nats.Name("jetbox-bench"), nats.MaxReconnects(-1))
		if err == nil {
			js, jerr := jetstream.New(nc, jetstream.WithPublishAsyncMaxPending(1<<16))
			if jerr == nil {
				actx, cancel := context.WithTimeout(ctx, time.Second)
				_, jerr = js.AccountInfo(actx)
				cancel()
			}
			if jerr == nil {
				s.nc, s.js = nc, js
				return nil
			}
			nc.Close()
			err = jerr
		}
		if s.nats.exited() {
			return fmt.Errorf("nats server exited at start:\n%s", s.nats.logTail(2048))
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return fmt.Errorf("nats server not ready: %w", errors.Join(err, ctx.Err()))
		}
		time.Sleep(20 * time.Millisecond) // readiness has no event to wait on
	}
}

// close stops NATS and Postgres and removes the cluster's files.
func (s *servers) close() {
	if s.nc != nil {
		s.nc.Close()
	}
	if s.nats != nil {
		_ = s.nats.stop(30 * time.Second)
	}
	if s.pg != nil {
		s.pg.Remove()
	}
}

// dsn is the superuser DSN of database db.
func (s *servers) dsn(db string) string {
	u, err := url.Parse(s.pg.DSN)
	if err != nil { // pgcluster builds it: cannot happen
		panic(err)
	}
	u.Path = "/" + db
	return u.String()
}

// createDatabase creates database db and runs ddl in it.
func (s *servers) createDatabase(ctx context.Context, db, ddl string) error {
	if err := s.exec(ctx, "postgres", "CREATE DATABASE "+pgx.Identifier{db}.Sanitize()); err != nil {
		return err
	}
	return s.exec(ctx, db, ddl)
}

// exec runs sql in database db on a fresh connection.
func (s *servers) exec(ctx context.Context, db, sql string, args ...any) error {
	conn, err := pgx.Connect(ctx, s.dsn(db))
	if err != nil {
		return fmt.Errorf("connect to database %s: %w", db, err)
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(ctx, sql, args...); err != nil {
		return fmt.Errorf("database %s: %w", db, err)
	}
	return nil
}

// postgresCPU is the CPU time the whole Postgres server used so far.
func (s *servers) postgresCPU() (time.Duration, error) { return treeCPU(s.pgPID) }

// freeAddr returns a 127.0.0.1 address with a port free at the time of the call.
func freeAddr() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", fmt.Errorf("find a free port: %w", err)
	}
	defer l.Close()
	return l.Addr().String(), nil
}

// deleteStream deletes a stream and waits until the NATS server has removed
// its files. The server renames the stream's directory to a dot-prefixed
// name, answers, and removes the files in the background (nats-server's
// fileStore.Delete); for a stream of gigabytes that is seconds of the
// server's kernel time (dropping the files' pages from the page cache),
// which would otherwise be timed as part of the next run.
func (s *servers) deleteStream(ctx context.Context, name string) error {
	streams := filepath.Join(s.natsStore, "jetstream", "$G", "streams")
	_, statErr := os.Stat(filepath.Join(streams, name))
	if err := s.js.DeleteStream(ctx, name); err != nil {
		return fmt.Errorf("delete stream %s: %w", name, err)
	}
	if statErr != nil {
		return nil // not where a file store keeps it: nothing to wait for
	}
	start := time.Now()
	for deadline := start.Add(5 * time.Minute); ; {
		_, err1 := os.Stat(filepath.Join(streams, name))
		_, err2 := os.Stat(filepath.Join(streams, "."+name))
		if errors.Is(err1, os.ErrNotExist) && errors.Is(err2, os.ErrNotExist) {
			s.log.Info().Str("stream", name).Stringer("took", time.Since(start)).Msg("the server removed the stream's files")
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("delete stream %s: its files in %s are still there after 5m", name, streams)
		}
		if err := wait.Sleep(ctx, 50*time.Millisecond); err != nil {
			return err
		}
	}
}
