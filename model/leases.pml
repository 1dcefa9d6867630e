/*
 * The celery-leases protocol (docs/explanation/protocol.md, with its
 * invariants in docs/guarantees.md) as a Promela model, checked with spin.
 *
 * One job, one message, NW workers. Every store operation is one atomic
 * step on the store's clock; a worker's steps interleave freely with the
 * clock's ticks and with the other workers, so "a worker pauses at any step
 * for any time" is every interleaving. The broker may hand a held message
 * to a second worker (a redelivery) and a worker may crash at any step; its
 * unacked message then goes back to the queue.
 *
 * Bounds: NW workers, a lease of TTL ticks, the store's clock ticking up
 * to MAXT and then jumping once to FAR (all leases taken before then have
 * run out), at most MAXCRASH crashes and MAXDUP broker redeliveries, all
 * of them before the jump. Owners are per claim: (worker, generation).
 *
 * Properties:
 *   - at most one unexpired holder (I2), no stale renew accepted (I4);
 *   - no stale completion accepted: an accepted completion carries the
 *     newest generation, and there is at most one (assertions);
 *   - the target's fence never regresses: every accepted write carries a
 *     generation >= every write accepted before it (assertion);
 *   - no job lost: at every state the job is completed or a copy of its
 *     message is queued or held by a live worker (NOT_LOST), and
 *     every run ends with the job completed (end-state assertion).
 *
 * Broken variants (compile with spin -D<NAME>), each must fail:
 *   NO_GENERATION_CHECK  complete does not compare (owner, generation)
 *   NO_FENCE             the target accepts every write
 *   NO_RENEW_CHECK       renew does not compare (owner, generation)
 *   WORKER_CLOCK_CLAIM   the claim decides expiry on a worker's clock that
 *                        runs SKEW ticks ahead of the store's
 *   DROP_ON_LOST         a run that lost its lease acks its message
 *                        without publishing it again
 */

#ifndef NW
#define NW 3
#endif
#define TTL 2
#define MAXT 4
#define FAR 100
#define MAXCRASH 1
#define MAXDUP 1

/* the store's record of the job */
int clock = 0;
byte generation = 0;     /* the fencing token of the newest claim */
byte holder = 0;         /* worker holding it, 0 when released or none */
int lease_until = 0;     /* on the store's clock */
bool completed = false;
byte completions = 0;    /* accepted completions */

/* the fenced target: the highest generation it accepted */
byte fence = 0;
byte last_write = 0;     /* the generation of the last accepted write */

/* the broker: copies of the message queued, and held unacked by workers */
byte queued = 1;
byte inflight = 0;
byte crashes = 0;
byte duplicates = 0;
byte finished = 0;       /* workers that ended */

/* no job lost: checked after every step that moves a message or completes */
#define NOT_LOST assert(completed || queued + inflight > 0)

#ifdef NO_GENERATION_CHECK
#define COMPLETE_GUARD(w, g) (!completed)
#else
#define COMPLETE_GUARD(w, g) (!completed && holder == w && generation == g)
#endif

#ifdef NO_RENEW_CHECK
#define RENEW_GUARD(w, g) (!completed)
#else
#define RENEW_GUARD(w, g) (!completed && holder == w && generation == g)
#endif

#ifdef WORKER_CLOCK_CLAIM
#define SKEW 1
#else
#define SKEW 0
#endif

#ifdef DROP_ON_LOST
#define REPUBLISH skip
#else
#define REPUBLISH queued++
#endif

#ifdef NO_FENCE
#define FENCE_GUARD(g) (true)
#else
#define FENCE_GUARD(g) (g >= fence)
#endif

/* A worker may crash at any step while crashes are left: its lease stays
 * in the store until it runs out; the broker gives its message back. */
#define CRASH_POINT \
    :: atomic { crashes < MAXCRASH && clock < MAXT -> \
           crashes++; inflight--; queued++; finished++; NOT_LOST; goto dead }

proctype Worker(byte me) {
    byte mine = 0;     /* the generation this run holds */
    int deadline = 0;  /* local deadline, from before the request was sent */
    int sent = 0;

idle:
    do
    :: atomic { queued > 0 -> queued--; inflight++ }
       break
    :: atomic { completed && queued == 0 -> finished++; goto dead }
    od;

    /* claim */
    sent = clock;
    if
    CRASH_POINT
    :: atomic {
           if
           :: completed -> inflight--; sent = 0; NOT_LOST; goto idle  /* skip, ack */
           :: !completed && holder != 0 && lease_until > clock + SKEW ->
                  queued++; inflight--; sent = 0; goto idle   /* held: defer */
           :: !completed && (holder == 0 || lease_until <= clock + SKEW) ->
                  /* at most one unexpired holder (I2) */
                  assert(holder == 0 || lease_until <= clock);
                  generation++; holder = me; lease_until = clock + TTL;
                  mine = generation; deadline = sent + TTL; sent = 0
           fi
       }
    fi;

    /* run: renew any number of times, write the target once */
    do
    CRASH_POINT
    :: sent = clock;   /* renew */
       if
       CRASH_POINT
       :: atomic {
              if
              :: RENEW_GUARD(me, mine) ->
                     /* no stale renew accepted (I4) */
                     assert(holder == me && generation == mine);
                     lease_until = clock + TTL; deadline = sent + TTL; sent = 0
              ::  else -> sent = 0; goto lost
              fi
          }
       fi
    :: clock < deadline -> break  /* the local deadline is checked before the write */
    :: clock >= deadline -> goto lost
    od;

    /* the write is on the wire: it may arrive much later */
    if
    CRASH_POINT
    :: atomic {
           if
           :: FENCE_GUARD(mine) ->
                  assert(mine >= last_write);  /* the fence never regresses */
                  fence = (mine > fence -> mine : fence);
                  last_write = mine
           :: else -> skip                     /* refused: a newer write won */
           fi
       }
    fi;

    /* complete, fenced */
    if
    CRASH_POINT
    :: atomic {
           if
           :: COMPLETE_GUARD(me, mine) ->
                  completed = true; completions++;
                  assert(completions == 1);
                  assert(mine == generation);  /* no stale completion */
                  inflight--; mine = 0; deadline = 0; NOT_LOST; goto idle
           :: else -> goto lost
           fi
       }
    fi;

lost:
    /* fenced out: release if the store still names this run, publish the
     * message again, ack this copy */
    atomic {
        if
        :: !completed && holder == me && generation == mine -> holder = 0
        :: else -> skip
        fi;
        REPUBLISH; inflight--; mine = 0; deadline = 0; NOT_LOST
    }
    goto idle;

dead:
    skip
}

/* The store's clock; after MAXT it jumps once past every lease. */
active proctype Clock() {
    do
    :: clock < MAXT -> clock++
    :: clock == MAXT -> clock = FAR; break
    od
}

/* The broker hands a held message to another worker (visibility timeout). */
active proctype Broker() {
    do
    :: atomic { duplicates < MAXDUP && inflight > 0 && clock < MAXT ->
           duplicates++; queued++ }
    :: atomic { duplicates == MAXDUP || clock >= MAXT -> break }
    od
}

/* Every run ends with the job completed. */
active proctype Judge() {
    atomic { finished >= NW || (completed && queued == 0 && inflight == 0) ->
             assert(completed) }
}

init {
    atomic {
        byte w = 1;
        do
        :: w <= NW -> run Worker(w); w++
        :: else -> break
        od
    }
}
