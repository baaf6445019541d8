package main

import (
	"context"
	"fmt"
	"io"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jetbox-dev/jetbox/sink"
	"github.com/rs/zerolog"
)

// statusCmd is `jetbox status`: one screen with the slot, the publication,
// the stream and the lag.
type statusCmd struct {
	RunFlags
}

func (c *statusCmd) run(ctx context.Context, stdout, stderr io.Writer) int {
	cfg, err := c.RunFlags.Config()
	if err != nil {
		printProblems(stderr, "configuration", err)
		return exitConfig
	}
	ctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	code := exitOK
	say := func(format string, a ...any) { fmt.Fprintf(stdout, format+"\n", a...) }

	conn, err := pgx.Connect(ctx, cfg.PostgresURL)
	if err != nil {
		say("postgres     unreachable: %s", redact(err.Error()))
		code = exitFailure
	} else {
		defer conn.Close(context.Background())
		var server, confirmed, walStatus, pid string
		var active bool
		var lag, retained int64
		err := conn.QueryRow(ctx, `SELECT CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() ELSE pg_current_wal_lsn() END::text, coalesce(s.confirmed_flush_lsn::text, '-'),
			coalesce(s.wal_status, '-'), coalesce(s.active, false), coalesce(s.active_pid::text, '-'),
			coalesce(pg_wal_lsn_diff(CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() ELSE pg_current_wal_lsn() END, s.confirmed_flush_lsn), 0)::bigint,
			coalesce(pg_wal_lsn_diff(CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() ELSE pg_current_wal_lsn() END, s.restart_lsn), 0)::bigint
			FROM (SELECT 1) one LEFT JOIN pg_replication_slots s ON s.slot_name = $1`, cfg.Replication.Slot).
			Scan(&server, &confirmed, &walStatus, &active, &pid, &lag, &retained)
		switch {
		case err != nil:
			say("postgres     %s", err)
			code = exitFailure
		case confirmed == "-" && walStatus == "-":
			say("slot         %s: missing (jetbox run creates it)", cfg.Replication.Slot)
		default:
			state := "inactive (no jetbox streaming)"
			if active {
				state = "active, walsender pid " + pid
			}
			say("slot         %s: %s, wal_status %s", cfg.Replication.Slot, state, walStatus)
			say("             confirmed %s, server at %s: lag %s, retains %s of WAL", confirmed, server, bytesText(lag), bytesText(retained))
		}
		var tables int
		var insert bool
		err = conn.QueryRow(ctx, `SELECT p.pubinsert, (SELECT count(*) FROM pg_publication_tables t WHERE t.pubname = p.pubname
			AND t.schemaname = $2 AND t.tablename = $3)::int FROM pg_publication p WHERE p.pubname = $1`,
			cfg.Replication.Publication, cfg.Replication.Decoder.Schema, cfg.Replication.Decoder.Table).Scan(&insert, &tables)
		switch {
		case err == pgx.ErrNoRows:
			say("publication  %s: missing (jetbox run creates it)", cfg.Replication.Publication)
		case err != nil:
			say("publication  %s", err)
		default:
			say("publication  %s: inserts %v, contains %s.%s: %v", cfg.Replication.Publication, insert,
				cfg.Replication.Decoder.Schema, cfg.Replication.Decoder.Table, tables > 0)
		}
	}

	nc, err := connectNATS(cfg, zerolog.Nop(), nil)
	if err != nil {
		say("nats         unreachable: %v", err)
		return exitFailure
	}
	defer nc.Close()
	js, err := sink.NewJetStream(nc, cfg.Sink.JSDomain)
	if err != nil {
		say("nats         %v", err)
		return exitFailure
	}
	s, err := js.Stream(ctx, cfg.Sink.Stream)
	if err != nil {
		say("stream       %s: %v", cfg.Sink.Stream, err)
		return code
	}
	info := s.CachedInfo()
	say("stream       %s: %d messages, last seq %d (at %s), subjects %v", cfg.Sink.Stream, info.State.Msgs, info.State.LastSeq,
		info.State.LastTime.UTC().Format(time.RFC3339), info.Config.Subjects)
	say("             duplicate window %s, %s storage, %d replica(s), %s", info.Config.Duplicates, info.Config.Storage,
		max(info.Config.Replicas, 1), bytesText(int64(info.State.Bytes)))
	return code
}

func bytesText(n int64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.1f GiB", float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%d B", n)
}
