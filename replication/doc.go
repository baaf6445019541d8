// Package replication owns the walsender connection: it starts logical
// replication on the slot, feeds pgoutput messages to the decoder, hands each
// event to the sink, and sends standby status updates whose flush position is
// the checkpoint tracker's safe LSN and nothing else.
//
// One goroutine does all I/O on the replication connection (pgconn is not safe
// for concurrent use). Status updates go out on a timer, at once when the
// server asks, and while the loop waits on a full publish window, so
// wal_sender_timeout never fires because JetStream is slow or down.
//
// # Files
//
//   - stream.go: Config, New and the Streamer: its state and Run, which
//     reconnects with backoff and stands by while another instance holds
//     the slot.
//   - defaults.go: the defaults New applies to a zero Config field (also
//     cmd/jetbox's flag defaults).
//   - contract.go: Sink and Session, what the streamer needs of a publisher.
//   - errors.go: IsPermanent (stop or reconnect), PermanentError and the
//     errors built here.
//   - session.go: one replication session: connect, the history and outbox
//     identity checks, START_REPLICATION, and finish.
//   - loop.go: the receive loop: read, decode, track in the window, publish.
//   - republish.go: recovery after failed publishes, on the same connection,
//     and the sink session's open and close while status updates go on.
//   - status.go: standby status updates (flush = the tracker's safe LSN).
//   - history.go: whether the server continues the stream's WAL history
//     (VerifyHistory, at every session open), and the Jetbox-Source value.
//   - replay.go: a slot starting at or before the stream's tip must replay
//     the history the stream holds before anything past the start is
//     confirmed.
//   - setup.go, failover.go: jetbox check's findings (failover.go: keeping
//     the slot across a promotion) and Ensure (publication, slot).
//   - columns.go: the outbox table's columns as pgoutput sends them
//     (domains by their base types, generated columns), judged alike by
//     jetbox check, start-up and repair.
//   - membership.go: how the table belongs to the publication, and whether
//     that changed since the slot or the last check.
//   - monitor.go: the slot monitor (lag, retained WAL, publication, heartbeats).
//   - snapshot.go: the repair snapshot (jetbox repair).
//   - sql.go: quoting for the SQL sent as text.
package replication
