/*
 * Which deliveries are the same run of a job (docs/guarantees.md, the
 * protocol's duty 7) as a Promela model, checked with spin.
 *
 * One job key (a custom lease_key), three sends of it, NW workers:
 *
 *   message 1: task id 1, send id 1   (a send by a producer with the library)
 *   message 2: task id 1, send id 2   (a new send of the same key that reuses
 *                                      task id 1: apply_async(task_id=...),
 *                                      a retry, a replace)
 *   message 3: task id 3, no send id  (send_task by name, with a new task id,
 *                                      from a producer that does not import
 *                                      the library)
 *
 * The broker may hand a held message to a second worker (a redelivery: the
 * same task id and send id), a worker that finds the lease held publishes a
 * deferred copy (the same task id and send id), and a worker may crash at
 * any step (its unacked message goes back to the queue). The record keeps
 * the send id and task id of the run that completed the job, and its
 * outcome; which message's run that was is `done_by`.
 *
 * The rule: a delivery of a completed job is the same run as the one that
 * completed it when it carries the same send id, or when it carries no send
 * id and the task id that completed the job. A same-run delivery is skipped
 * and answers its client with the kept outcome; any other delivery is a new
 * run, serialized by the lease.
 *
 * Properties:
 *   - each send's client gets its own run's answer: a skipped delivery is
 *     answered only with an outcome its own send's run kept (assertion);
 *   - no job lost: every message is answered or a copy of it is queued or
 *     held (NOT_LOST), and every run ends with every message answered;
 *   - I2 at most one unexpired holder; I3 at most one accepted completion
 *     per generation, and it carries the newest generation; I4 no stale
 *     renew or completion accepted; I5 the fenced target never regresses.
 *
 * Broken variants of the rule (compile with spin -D<NAME>), each must fail:
 *   NO_ID_SAME_RUN     a message without a send id is the same run as
 *                      whatever completed the job
 *   SAME_KEY_SAME_RUN  every delivery of a completed key is the same run
 *   IGNORE_SEND_ID     the task id alone decides
 *   SEND_OR_TASK_ID    the same send id or the same task id decides
 */

#ifndef NW
#define NW 2
#endif
#define NM 3
#define TTL 2
#define MAXT 3
#define FAR 100
#define MAXCRASH 1
#define MAXDUP 1

/* the sends: task id and send id (0: none) of each message, 1..NM */
byte task_of[NM + 1];
byte send_of[NM + 1];

/* the store's record of the job */
int clock = 0;
byte generation = 0;
byte holder = 0;          /* worker holding it, 0 when released or none */
int lease_until = 0;
bool completed = false;
byte done_by = 0;         /* the message whose run completed the job */
byte last_completed = 0;  /* the generation of the last accepted completion */

/* the fenced target */
byte fence = 0;
byte last_write = 0;

/* the broker: copies of each message queued, and held unacked by workers */
byte queued[NM + 1] = 1;
byte inflight[NM + 1];
bool answered[NM + 1];
byte crashes = 0;
byte duplicates = 0;
byte finished = 0;

#define ALL_ANSWERED (answered[1] && answered[2] && answered[3])
#define NONE_QUEUED (queued[1] + queued[2] + queued[3] == 0)
#define NONE_INFLIGHT (inflight[1] + inflight[2] + inflight[3] == 0)
#define NOT_LOST(i) assert(answered[i] || queued[i] + inflight[i] > 0)

/* Is a delivery of message i the same run as the run of message c that
 * completed the job? */
#if defined(NO_ID_SAME_RUN)
#define SAME_RUN(i, c) (send_of[i] == 0 || send_of[i] == send_of[c])
#elif defined(SAME_KEY_SAME_RUN)
#define SAME_RUN(i, c) (true)
#elif defined(IGNORE_SEND_ID)
#define SAME_RUN(i, c) (task_of[i] == task_of[c])
#elif defined(SEND_OR_TASK_ID)
#define SAME_RUN(i, c) ((send_of[i] != 0 && send_of[i] == send_of[c]) || task_of[i] == task_of[c])
#else
#define SAME_RUN(i, c) \
    ((send_of[i] != 0 && send_of[i] == send_of[c]) || \
     (send_of[i] == 0 && task_of[i] == task_of[c]))
#endif

#define CRASH_POINT \
    :: atomic { crashes < MAXCRASH && clock < MAXT -> \
           crashes++; inflight[m]--; queued[m]++; finished++; goto dead }

#define TAKE(i) :: atomic { queued[i] > 0 -> queued[i]--; inflight[i]++; m = i }; break

proctype Worker(byte me) {
    byte m = 0;        /* the message this worker delivers */
    byte mine = 0;     /* the generation this run holds */
    int deadline = 0;
    int sent = 0;

idle:
    m = 0;
    do
    TAKE(1)
    TAKE(2)
    TAKE(3)
    :: atomic { ALL_ANSWERED && NONE_QUEUED -> finished++; goto dead }
    od;

    /* claim */
    sent = clock;
    if
    CRASH_POINT
    :: atomic {
           if
           :: completed && SAME_RUN(m, done_by) ->
                  /* skipped: its client gets the kept outcome, which must be
                   * its own send's run's answer */
                  assert(done_by == m);
                  answered[m] = true; inflight[m]--; sent = 0; goto idle
           :: !completed && holder != 0 && lease_until > clock ->
                  /* held: a deferred copy, the same task id and send id */
                  queued[m]++; inflight[m]--; sent = 0; goto idle
           :: (completed && !SAME_RUN(m, done_by)) ||
              (!completed && (holder == 0 || lease_until <= clock)) ->
                  /* a new run, or a takeover: at most one unexpired holder (I2) */
                  assert(completed || holder == 0 || lease_until <= clock);
                  generation++; holder = me; lease_until = clock + TTL;
                  completed = false; done_by = 0;
                  mine = generation; deadline = sent + TTL; sent = 0
           fi
       }
    fi;

    /* run: renew any number of times, write the target once */
    do
    CRASH_POINT
    :: sent = clock;
       if
       CRASH_POINT
       :: atomic {
              if
              :: !completed && holder == me && generation == mine ->
                     lease_until = clock + TTL; deadline = sent + TTL; sent = 0
              :: else -> sent = 0; goto lost
              fi
          }
       fi
    :: clock < deadline -> break
    :: clock >= deadline -> goto lost
    od;

    if
    CRASH_POINT
    :: atomic {
           if
           :: mine >= fence ->
                  assert(mine >= last_write);  /* I5 */
                  fence = mine; last_write = mine
           :: else -> skip
           fi
       }
    fi;

    /* complete, fenced */
    if
    CRASH_POINT
    :: atomic {
           if
           :: !completed && holder == me && generation == mine ->
                  /* I3, I4: one completion per generation, the newest one */
                  assert(mine == generation && mine > last_completed);
                  completed = true; done_by = m; last_completed = mine;
                  answered[m] = true; inflight[m]--;
                  mine = 0; deadline = 0; goto idle
           :: else -> goto lost
           fi
       }
    fi;

lost:
    /* fenced out: release if the store still names this run, publish the
     * message again (a copy of the same send), ack this one */
    atomic {
        if
        :: !completed && holder == me && generation == mine -> holder = 0
        :: else -> skip
        fi;
        queued[m]++; inflight[m]--; mine = 0; deadline = 0; NOT_LOST(m)
    }
    goto idle;

dead:
    skip
}

active proctype Clock() {
    do
    :: clock < MAXT -> clock++
    :: clock == MAXT -> clock = FAR; break
    od
}

/* The broker hands a held message to another worker (visibility timeout). */
#define REDELIVER(i) \
    :: atomic { duplicates < MAXDUP && inflight[i] > 0 && clock < MAXT -> \
           duplicates++; queued[i]++ }

active proctype Broker() {
    do
    REDELIVER(1)
    REDELIVER(2)
    REDELIVER(3)
    :: atomic { duplicates == MAXDUP || clock >= MAXT -> break }
    od
}

/* Every message is answered, and none is lost on the way. */
active proctype Judge() {
    do
    :: atomic { !ALL_ANSWERED -> NOT_LOST(1); NOT_LOST(2); NOT_LOST(3) }
    :: atomic { finished >= NW || (ALL_ANSWERED && NONE_QUEUED && NONE_INFLIGHT) ->
           assert(ALL_ANSWERED); break }
    od
}

init {
    atomic {
        task_of[1] = 1; send_of[1] = 1;
        task_of[2] = 1; send_of[2] = 2;
        task_of[3] = 3; send_of[3] = 0;
        byte w = 1;
        do
        :: w <= NW -> run Worker(w); w++
        :: else -> break
        od
    }
}
