package replication

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jetbox-dev/jetbox/checkpoint"
	"github.com/jetbox-dev/jetbox/decoder"
)

// replicate is one replication connection from START_REPLICATION to its end.
func (s *Streamer) replicate(ctx context.Context) (err error) {
	// Bound the whole set-up: a blackholed network would hang it forever.
	sctx, cancel := context.WithTimeout(ctx, s.cfg.Timeout)
	defer cancel()
	conn, err := pgconn.ConnectConfig(sctx, s.connCfg)
	if err != nil {
		return fmt.Errorf("connect for replication: %w", err)
	}
	defer func() {
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
		defer cancel()
		conn.Close(cctx)
	}()

	// Never start a new history silently: the server must continue the
	// stream's (slot kept, no rewind, a timeline that branched after it).
	ts, _ := s.sink.(TipSource)
	srv, tip, haveTip, err := checkHistory(sctx, conn, s.cfg, ts, s.log)
	if err != nil {
		return err
	}
	if err := s.checkOutboxOID(sctx, conn); err != nil {
		return err
	}
	// The Relation message names a domain column's type by the domain's
	// OID: the decoder reads it as its base type (as check judged it).
	var domains decoder.Domains
	var partitions outboxPartitions
	if s.cfg.hasTable() {
		if domains, err = readDomains(sctx, conn); err != nil {
			return err
		}
		// A publication without publish_via_partition_root names a
		// partitioned outbox's rows after its partitions.
		if partitions, err = readPartitions(sctx, conn, s.cfg); err != nil {
			return err
		}
	}
	if err := s.checkMembership(sctx, conn); err != nil {
		return err
	}
	sys := srv.sys
	start, err := slotPosition(sctx, conn, s.cfg.Slot)
	if err != nil {
		return err
	}
	// The tip's transaction, if replayed, must be counted as it was stored.
	if haveTip && ownTip(tip, sys, s.cfg.Slot) {
		if err := checkScheme(tip, s.cfg.Decoder.IndexScheme(), start); err != nil {
			return err
		}
		// Routing and atomic mode as the stream's consumers were promised.
		if err := checkSettings(tip, s.cfg, start, s.log); err != nil {
			return err
		}
	}
	// A slot at or before the tip replays it: until it has (tipReplay),
	// nothing past start is confirmed.
	var replay *tipReplay
	if haveTip && ownTip(tip, sys, s.cfg.Slot) && tip.Seq > s.forgotTip {
		replay = newTipReplay(tip, start)
	}
	var gate *recoveryGate
	standby, err := inRecovery(sctx, conn)
	if err != nil {
		return err
	}
	// A promotion since IDENTIFY_SYSTEM (checkHistory) moved the server
	// to another timeline than the one the events would be labelled with.
	if now, err := pglogrepl.IdentifySystem(sctx, conn); err != nil {
		return fmt.Errorf("identify system: %w", err)
	} else if now.Timeline != sys.Timeline {
		return fmt.Errorf("the server moved from timeline %d to %d while the session started (a promotion): starting again", sys.Timeline, now.Timeline)
	}
	if standby {
		if gate, err = openRecoveryGate(sctx, s.connString, sys.Timeline); err != nil {
			return err
		}
		defer gate.close()
	}
	slots, err := s.openStandbyGate(sctx, conn.PID())
	if err != nil {
		return err
	}
	defer slots.close()
	source := sourceOf(sys, s.cfg.Slot)
	args := []string{"proto_version '1'", "publication_names " + quoteLiteral(quoteIdent(s.cfg.Publication))}
	if s.cfg.Decoder.MessagePrefix != "" {
		args = append(args, "messages 'true'") // PostgreSQL 14+ (checked by Check)
	}
	// Start at 0/0: the server resumes from the slot's confirmed_flush_lsn.
	if err := pglogrepl.StartReplication(sctx, conn, quoteIdent(s.cfg.Slot), 0,
		pglogrepl.StartReplicationOptions{Mode: pglogrepl.LogicalReplication, PluginArgs: args}); err != nil {
		return fmt.Errorf("start replication on slot %q: %w", s.cfg.Slot, err)
	}
	log := s.log.With().Str("publication", s.cfg.Publication).Logger()
	l := &loop{
		s:       s,
		conn:    conn,
		log:     log,
		tracker: checkpoint.New[*decoder.Event](start, s.cfg.MaxInFlight, s.cfg.MaxInFlightBytes),
		dec:     decoder.New(s.cfg.Decoder),
		source:  source,
		start:   start,
		replay:  replay,
		gate:    gate,
		slots:   slots,
		// The first status goes out as the loop starts (run), or
		// meanwhile if opening the sink takes longer than an interval.
		nextStatus: time.Now().Add(s.cfg.StatusInterval),
	}
	l.dec.SetOutbox(s.outbox)
	l.dec.SetDomains(domains)
	l.dec.SetOrigin(source)
	defer setPartitions(l.dec, partitions, s.connString)()
	s.sent.Store(uint64(start))
	// Open the sink only now that this instance holds the slot: a standby
	// (START_REPLICATION refused, another instance streams) must not take
	// the stream's tip for its own last ack, and the previous holder's
	// walsender is gone, so the sink reads the stream after what it stored
	// (a late store of one it had in flight fails our first expected
	// sequence: republished). The walsender waits for nothing but our
	// status meanwhile (openSession sends it).
	sess, err := l.openSession(sctx)
	if err != nil {
		return fmt.Errorf("open publishing session: %w", err)
	}
	l.sess = sess
	if s.State() == StateStandby {
		log.Info().Str("confirmed_lsn", start.String()).Msg("took over the slot")
	}
	log.Info().Str("confirmed_lsn", start.String()).Str("source", source).Msg("streaming")
	s.setState(StateStreaming)
	err = l.run(ctx)
	return l.finish(ctx, err)
}

// checkOutboxOID reads the outbox table's relation OID over the replication
// connection. The first session records it, with the WAL position it was
// read at, for the decoders and the monitor; a later session that finds
// another OID stops jetbox: the table was dropped and recreated meanwhile.
func (s *Streamer) checkOutboxOID(ctx context.Context, conn *pgconn.PgConn) error {
	if !s.cfg.hasTable() {
		return nil
	}
	table := s.cfg.quotedTable()
	res, err := conn.Exec(ctx, "SELECT coalesce(to_regclass("+quoteLiteral(table)+")::oid, 0)::text, ("+serverLSNSQL+")::text").ReadAll()
	if err != nil {
		return fmt.Errorf("read the relation OID of %s: %w", s.cfg.qualifiedTable(), err)
	}
	if len(res) != 1 || len(res[0].Rows) != 1 {
		return fmt.Errorf("read the relation OID of %s: no row", s.cfg.qualifiedTable())
	}
	oid, err := strconv.ParseUint(string(res[0].Rows[0][0]), 10, 32)
	if err != nil {
		return fmt.Errorf("parse the relation OID of %s: %w", s.cfg.qualifiedTable(), err)
	}
	lsn, err := pglogrepl.ParseLSN(string(res[0].Rows[0][1]))
	if err != nil {
		return fmt.Errorf("parse pg_current_wal_lsn: %w", err)
	}
	switch first := s.outbox.OID; {
	case oid == 0: // dropped: the monitor and the publication check report it
	case first == 0:
		s.outbox = decoder.OutboxIdentity{OID: uint32(oid), LSN: lsn}
		s.startOID.Store(uint32(oid))
	case uint32(oid) != first:
		return &PermanentError{Err: s.replacedError(first, uint32(oid), "while jetbox was reconnecting")}
	}
	return nil
}

// slotPosition reads the slot's confirmed_flush_lsn over the replication
// connection (walsenders in database mode accept simple SQL).
func slotPosition(ctx context.Context, conn *pgconn.PgConn, slot string) (pglogrepl.LSN, error) {
	res, err := conn.Exec(ctx, "SELECT coalesce(confirmed_flush_lsn::text, '0/0') FROM pg_replication_slots WHERE slot_name = "+quoteLiteral(slot)).ReadAll()
	if err != nil {
		return 0, fmt.Errorf("read slot %q: %w", slot, err)
	}
	if len(res) != 1 || len(res[0].Rows) == 0 {
		return 0, &PermanentError{Err: fmt.Errorf("replication slot %q does not exist (dropped while jetbox ran?): rows committed since it was dropped cannot be streamed; re-publish them from the table, then restart jetbox, which creates a new slot", slot)}
	}
	lsn, err := pglogrepl.ParseLSN(string(res[0].Rows[0][0]))
	if err != nil {
		return 0, fmt.Errorf("parse confirmed_flush_lsn of slot %q: %w", slot, err)
	}
	return lsn, nil
}

// finish ends the session: it stops reading, waits (bounded) for in-flight
// acks, confirms what is safe, and returns the session's error.
func (l *loop) finish(ctx context.Context, runErr error) error {
	// Bound every write of the shutdown path: the connection may be dead.
	_ = l.conn.Conn().SetDeadline(time.Now().Add(l.s.cfg.ShutdownTimeout + 2*time.Second))
	if err := l.closeSession(ctx, l.s.cfg.ShutdownTimeout); err != nil && runErr == nil {
		runErr = err
	}
	l.tracker.Close()
	// A connection pgconn closed on a read error (the server died) is
	// closed by a goroutine of its own, which writes its buffers: no final
	// status on it (it could not be sent, and it would race that write).
	if l.conn.IsClosed() {
		l.log.Debug().Msg("final standby status not sent: the connection is closed")
	} else if err := l.sendStatus(false); err != nil && runErr == nil {
		l.log.Warn().Err(err).Msg("final standby status not sent")
	}
	events, _ := l.tracker.InFlight()
	l.log.Info().Str("confirmed_lsn", l.tracker.Safe().String()).Int("unacked", events).Msg("replication session stopped")
	if ctx.Err() != nil && (runErr == nil || errors.Is(runErr, context.Canceled)) {
		return nil
	}
	return runErr
}

// inRecovery reports, over the replication connection, whether the server
// is a standby.
func inRecovery(ctx context.Context, conn *pgconn.PgConn) (bool, error) {
	res, err := conn.Exec(ctx, "SELECT pg_is_in_recovery()").ReadAll()
	if err != nil {
		return false, fmt.Errorf("read pg_is_in_recovery: %w", err)
	}
	if len(res) != 1 || len(res[0].Rows) != 1 || len(res[0].Rows[0]) != 1 {
		return false, errors.New("read pg_is_in_recovery: unexpected result")
	}
	return string(res[0].Rows[0][0]) == "t", nil
}
