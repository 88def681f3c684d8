/* fastfake: a fast fake vLLM engine for the gateway overhead benchmark (bench/overhead.py).

   One thread, epoll, HTTP/1.1 keep-alive, bound to 127.0.0.1 only. It answers with canned,
   vLLM 0.32-shaped bodies so that the engine costs next to nothing and the gateway's own cost shows:
     POST /v1/chat/completions   16 output tokens; "stream":true gives a role chunk, 16 content chunks,
                                 a usage chunk (with "include_usage":true) and [DONE], chunked encoding,
                                 one SSE event per write, interleaved across connections (as a real
                                 engine emits tokens); a body with "do_remote_decode":true is a PD
                                 prefill leg: one token, finish_reason "length" and a kv_transfer_params
                                 ticket; "do_remote_prefill":true (a decode leg) reports the prompt as cached
     POST /v1/messages           the same 16 tokens as vLLM 0.32's Anthropic route answers them: a Message
                                 (one text block, stop_reason "max_tokens", usage with the cache counts of
                                 --enable-prompt-tokens-details); "stream":true gives named SSE events
                                 (message_start, content_block_start, 16 content_block_delta,
                                 content_block_stop, message_delta with usage, message_stop; no ping, no
                                 [DONE]), chunked and interleaved as chat's; the PD flags as chat's (the
                                 Coordinator's Messages prefill leg is a /v1/messages request: its answer
                                 is a one-token Message with the kv_transfer_params ticket)
     GET /health                 200
     GET /metrics                vllm:num_requests_running / waiting / kv_cache_usage_perc gauges, and
                                 fastfake_requests_total / fastfake_connections_total (accepted)
     GET /v1/models              the one model
   Request bodies must carry Content-Length (aiohttp, wrk and vllm-router all send it). The body is not
   parsed as JSON: the flags above are found by substring search, which is all a fake needs.

   Build: gcc -O2 -o fastfake fastfake.c      Run: fastfake PORT [MODEL]
*/
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#define TOKENS 16
#define PROMPT_TOKENS 12
#define MAX_BODY (16 * 1024 * 1024)
#define MAX_EVENTS 256

typedef struct {
    char *p;
    size_t len, cap, off; /* off: bytes already consumed (input) or written (output) */
} buf_t;

typedef struct conn {
    int fd;
    buf_t in, out;
    int stream_left; /* SSE events still to send for the current streamed answer (0: none) */
    int stream_kind; /* bit 0: include usage, bit 1: decode leg (cached prompt), bit 2: /v1/messages */
    int close_after;
    int want_out;    /* EPOLLOUT registered */
    struct conn *next_streaming, *prev_streaming;
    int in_stream_list;
} conn_t;

static int port;
static const char *model = "bench";
static int epfd;
static conn_t *streaming_head; /* connections with SSE events still to send */
static long served, accepted; /* reported on /metrics: a gateway's connection reuse shows in their ratio */

static void buf_add(buf_t *b, const char *s, size_t n) {
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->len + n) cap *= 2;
        b->p = realloc(b->p, cap);
        if (!b->p) { perror("realloc"); exit(1); }
        b->cap = cap;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
}

static void buf_compact(buf_t *b) {
    if (b->off == 0) return;
    memmove(b->p, b->p + b->off, b->len - b->off);
    b->len -= b->off;
    b->off = 0;
}

/* ---- canned bodies, built once ---------------------------------------------------------------- */

static char chat_json[4096], prefill_json[4096], decode_json[4096];
static char role_event[1024], token_events[TOKENS][1024], usage_event[1024], usage_cached_event[1024];
static const char done_event[] = "data: [DONE]\n\n";
static char metrics_body[2048], models_body[1024];
/* /v1/messages: a Message for a whole request, a prefill leg and a decode leg; the stream's events */
#define MSG_EVENTS (2 + TOKENS + 3) /* message_start, block start, deltas, block stop, message_delta, stop */
static char msg_json[4096], msg_prefill_json[4096], msg_decode_json[4096];
static char msg_start_event[1024], msg_block_start_event[256], msg_delta_events[TOKENS][512];
static char msg_block_stop_event[256], msg_usage_event[512], msg_usage_cached_event[512];
static const char msg_stop_event[] = "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n";
static const char *words[TOKENS] = {"The", " quick", " brown", " fox", " jumps", " over", " the", " lazy",
                                    " dog", " and", " runs", " far", " into", " the", " green", " hills"};

static void build_bodies(void) {
    char text[512] = "";
    for (int i = 0; i < TOKENS; i++) strcat(text, words[i]);
    const char *usage_fmt = "{\"prompt_tokens\":%d,\"total_tokens\":%d,\"completion_tokens\":%d,"
                            "\"prompt_tokens_details\":{\"cached_tokens\":%d}}";
    char usage[256], usage1[256], usage_cached[256];
    snprintf(usage, sizeof usage, usage_fmt, PROMPT_TOKENS, PROMPT_TOKENS + TOKENS, TOKENS, 0);
    snprintf(usage1, sizeof usage1, usage_fmt, PROMPT_TOKENS, PROMPT_TOKENS + 1, 1, 0);
    snprintf(usage_cached, sizeof usage_cached, usage_fmt, PROMPT_TOKENS, PROMPT_TOKENS + TOKENS, TOKENS, PROMPT_TOKENS);
    const char *chat_fmt =
        "{\"id\":\"chatcmpl-fastfake\",\"object\":\"chat.completion\",\"created\":1700000000,\"model\":\"%s\","
        "\"choices\":[{\"index\":0,\"message\":{\"role\":\"assistant\",\"content\":\"%s\",\"refusal\":null,"
        "\"annotations\":null,\"audio\":null,\"function_call\":null,\"tool_calls\":[],\"reasoning\":null},"
        "\"logprobs\":null,\"finish_reason\":\"length\",\"stop_reason\":null,\"token_ids\":null}],"
        "\"service_tier\":null,\"system_fingerprint\":null,\"usage\":%s,\"prompt_logprobs\":null,"
        "\"prompt_token_ids\":null,\"kv_transfer_params\":%s}";
    char ticket[1024];
    snprintf(ticket, sizeof ticket,
             "{\"do_remote_prefill\":true,\"do_remote_decode\":false,\"remote_block_ids\":[[2,3]],"
             "\"remote_engine_id\":\"fastfake-%d\",\"remote_request_id\":\"cmpl-fastfake\","
             "\"remote_host\":\"127.0.0.1\",\"remote_port\":%d,\"tp_size\":1,\"dcp_size\":1,\"pp_size\":1,"
             "\"remote_num_tokens\":%d,\"remote_blocks_expiry_time\":null,\"transfer_mode\":\"pull\","
             "\"remote_prefill_cached_tokens\":0}",
             port, port, PROMPT_TOKENS);
    snprintf(chat_json, sizeof chat_json, chat_fmt, model, text, usage, "null");
    snprintf(prefill_json, sizeof prefill_json, chat_fmt, model, words[0], usage1, ticket);
    snprintf(decode_json, sizeof decode_json, chat_fmt, model, text, usage_cached, "null");

    const char *head = "data: {\"id\":\"chatcmpl-fastfake\",\"object\":\"chat.completion.chunk\","
                       "\"created\":1700000000,\"model\":\"";
    snprintf(role_event, sizeof role_event,
             "%s%s\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},"
             "\"logprobs\":null,\"finish_reason\":null}]}\n\n", head, model);
    for (int i = 0; i < TOKENS; i++) {
        int last = i == TOKENS - 1;
        snprintf(token_events[i], sizeof token_events[i],
                 "%s%s\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"%s\"},\"logprobs\":null,"
                 "\"finish_reason\":%s%s}]}\n\n", head, model, words[i], last ? "\"length\"" : "null",
                 last ? ",\"stop_reason\":null" : "");
    }
    snprintf(usage_event, sizeof usage_event, "%s%s\",\"choices\":[],\"usage\":%s}\n\n", head, model, usage);
    snprintf(usage_cached_event, sizeof usage_cached_event, "%s%s\",\"choices\":[],\"usage\":%s}\n\n", head,
             model, usage_cached);

    /* vLLM's _build_anthropic_usage with prompt token details: input_tokens is the prompt less the cache
       reads and writes; a decode leg counts the pulled KV as read from the cache. */
    const char *musage_fmt = "{\"input_tokens\":%d,\"output_tokens\":%d,\"cache_creation_input_tokens\":0,"
                             "\"cache_read_input_tokens\":%d}";
    char musage[256], musage1[256], musage_cached[256];
    snprintf(musage, sizeof musage, musage_fmt, PROMPT_TOKENS, TOKENS, 0);
    snprintf(musage1, sizeof musage1, musage_fmt, PROMPT_TOKENS, 1, 0);
    snprintf(musage_cached, sizeof musage_cached, musage_fmt, 0, TOKENS, PROMPT_TOKENS);
    const char *msg_fmt = "{\"id\":\"msg_fastfake\",\"type\":\"message\",\"role\":\"assistant\","
                          "\"content\":[{\"type\":\"text\",\"text\":\"%s\"}],\"model\":\"%s\","
                          "\"stop_reason\":\"max_tokens\",\"usage\":%s%s%s}";
    snprintf(msg_json, sizeof msg_json, msg_fmt, text, model, musage, "", "");
    snprintf(msg_prefill_json, sizeof msg_prefill_json, msg_fmt, words[0], model, musage1,
             ",\"kv_transfer_params\":", ticket);
    snprintf(msg_decode_json, sizeof msg_decode_json, msg_fmt, text, model, musage_cached, "", "");
    /* message_start is built from the engine's first output, which has no cache details: the whole prompt */
    snprintf(msg_start_event, sizeof msg_start_event,
             "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_fastfake\","
             "\"type\":\"message\",\"role\":\"assistant\",\"content\":[],\"model\":\"%s\",\"stop_reason\":null,"
             "\"stop_sequence\":null,\"usage\":{\"input_tokens\":%d,\"output_tokens\":0}}}\n\n",
             model, PROMPT_TOKENS);
    snprintf(msg_block_start_event, sizeof msg_block_start_event,
             "event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,"
             "\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n");
    for (int i = 0; i < TOKENS; i++)
        snprintf(msg_delta_events[i], sizeof msg_delta_events[i],
                 "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,"
                 "\"delta\":{\"type\":\"text_delta\",\"text\":\"%s\"}}\n\n", words[i]);
    snprintf(msg_block_stop_event, sizeof msg_block_stop_event,
             "event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\n");
    const char *mdelta_fmt = "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":"
                             "\"max_tokens\",\"stop_sequence\":null},\"usage\":%s}\n\n";
    snprintf(msg_usage_event, sizeof msg_usage_event, mdelta_fmt, musage);
    snprintf(msg_usage_cached_event, sizeof msg_usage_cached_event, mdelta_fmt, musage_cached);

    snprintf(metrics_body, sizeof metrics_body,
             "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
             "# TYPE vllm:num_requests_running gauge\n"
             "vllm:num_requests_running{engine=\"0\",model_name=\"%s\"} 0.0\n"
             "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
             "# TYPE vllm:num_requests_waiting gauge\n"
             "vllm:num_requests_waiting{engine=\"0\",model_name=\"%s\"} 0.0\n"
             "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
             "# TYPE vllm:kv_cache_usage_perc gauge\n"
             "vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"%s\"} 0.0\n",
             model, model, model);
    snprintf(models_body, sizeof models_body,
             "{\"object\":\"list\",\"data\":[{\"id\":\"%s\",\"object\":\"model\",\"created\":1700000000,"
             "\"owned_by\":\"vllm\",\"root\":\"%s\",\"parent\":null,\"max_model_len\":8192}]}", model, model);
}

/* ---- connections -------------------------------------------------------------------------------- */

static void set_events(conn_t *c, int want_out) {
    if (c->want_out == want_out) return;
    struct epoll_event ev = {.events = EPOLLIN | (want_out ? EPOLLOUT : 0), .data.ptr = c};
    epoll_ctl(epfd, EPOLL_CTL_MOD, c->fd, &ev);
    c->want_out = want_out;
}

static void stream_list_remove(conn_t *c) {
    if (!c->in_stream_list) return;
    if (c->prev_streaming) c->prev_streaming->next_streaming = c->next_streaming;
    else streaming_head = c->next_streaming;
    if (c->next_streaming) c->next_streaming->prev_streaming = c->prev_streaming;
    c->next_streaming = c->prev_streaming = NULL;
    c->in_stream_list = 0;
}

static void stream_list_add(conn_t *c) {
    if (c->in_stream_list) return;
    c->prev_streaming = NULL;
    c->next_streaming = streaming_head;
    if (streaming_head) streaming_head->prev_streaming = c;
    streaming_head = c;
    c->in_stream_list = 1;
}

static void conn_close(conn_t *c) {
    stream_list_remove(c);
    epoll_ctl(epfd, EPOLL_CTL_DEL, c->fd, NULL);
    close(c->fd);
    free(c->in.p);
    free(c->out.p);
    free(c);
}

/* Write what is buffered; returns -1 when the connection is gone. */
static int conn_flush(conn_t *c) {
    while (c->out.off < c->out.len) {
        ssize_t n = write(c->fd, c->out.p + c->out.off, c->out.len - c->out.off);
        if (n > 0) { c->out.off += (size_t)n; continue; }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) { set_events(c, 1); return 0; }
        return -1;
    }
    c->out.off = c->out.len = 0;
    set_events(c, 0);
    return 0;
}

static void respond(conn_t *c, int status, const char *ctype, const char *body, size_t len) {
    char head[256];
    const char *reason = status == 200 ? "OK" : status == 404 ? "Not Found" : "Bad Request";
    int n = snprintf(head, sizeof head,
                     "HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %zu\r\n%s\r\n", status, reason,
                     ctype, len, c->close_after ? "connection: close\r\n" : "");
    buf_add(&c->out, head, (size_t)n);
    buf_add(&c->out, body, len);
}

static void add_chunk(conn_t *c, const char *data) {
    char size[32];
    size_t len = strlen(data);
    int n = snprintf(size, sizeof size, "%zx\r\n", len);
    buf_add(&c->out, size, (size_t)n);
    buf_add(&c->out, data, len);
    buf_add(&c->out, "\r\n", 2);
}

/* The next SSE event of a streamed answer: index counts down from the total. */
static void stream_step(conn_t *c) {
    if (c->stream_kind & 4) {
        int i = MSG_EVENTS - c->stream_left;
        if (i == 0) add_chunk(c, msg_start_event);
        else if (i == 1) add_chunk(c, msg_block_start_event);
        else if (i <= 1 + TOKENS) add_chunk(c, msg_delta_events[i - 2]);
        else if (i == 2 + TOKENS) add_chunk(c, msg_block_stop_event);
        else if (i == 3 + TOKENS) add_chunk(c, (c->stream_kind & 2) ? msg_usage_cached_event : msg_usage_event);
        else {
            add_chunk(c, msg_stop_event);
            buf_add(&c->out, "0\r\n\r\n", 5);
        }
        c->stream_left--;
        return;
    }
    int total = 1 + TOKENS + ((c->stream_kind & 1) ? 1 : 0) + 1;
    int i = total - c->stream_left;
    if (i == 0) add_chunk(c, role_event);
    else if (i <= TOKENS) add_chunk(c, token_events[i - 1]);
    else if (i == TOKENS + 1 && (c->stream_kind & 1)) add_chunk(c, (c->stream_kind & 2) ? usage_cached_event : usage_event);
    else {
        add_chunk(c, done_event);
        buf_add(&c->out, "0\r\n\r\n", 5);
    }
    c->stream_left--;
}

static int has(const char *body, size_t len, const char *a, const char *b) {
    return memmem(body, len, a, strlen(a)) || memmem(body, len, b, strlen(b));
}

static void handle(conn_t *c, const char *method, const char *path, const char *body, size_t blen) {
    served++;
    int chat = strcmp(path, "/v1/chat/completions") == 0, messages = strcmp(path, "/v1/messages") == 0;
    if (strcmp(method, "POST") == 0 && (chat || messages)) {
        int prefill = has(body, blen, "\"do_remote_decode\":true", "\"do_remote_decode\": true");
        int decode = has(body, blen, "\"do_remote_prefill\":true", "\"do_remote_prefill\": true");
        int stream = !prefill && has(body, blen, "\"stream\":true", "\"stream\": true");
        if (!stream) {
            const char *j = messages ? (prefill ? msg_prefill_json : decode ? msg_decode_json : msg_json)
                                     : (prefill ? prefill_json : decode ? decode_json : chat_json);
            respond(c, 200, "application/json", j, strlen(j));
            return;
        }
        const char *head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
                           "cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n";
        buf_add(&c->out, head, strlen(head));
        if (messages) {
            c->stream_kind = 4 | (decode ? 2 : 0);
            c->stream_left = MSG_EVENTS;
        } else {
            c->stream_kind = (has(body, blen, "\"include_usage\":true", "\"include_usage\": true") ? 1 : 0) |
                             (decode ? 2 : 0);
            c->stream_left = 1 + TOKENS + (c->stream_kind & 1) + 1;
        }
        stream_step(c); /* the first event goes with the headers; the rest one per loop turn */
        stream_list_add(c);
        return;
    }
    if (strcmp(method, "GET") == 0 && strcmp(path, "/health") == 0) { respond(c, 200, "text/plain", "", 0); return; }
    if (strcmp(method, "GET") == 0 && strcmp(path, "/metrics") == 0) {
        char m[sizeof metrics_body + 256];
        int n = snprintf(m, sizeof m, "%sfastfake_requests_total %ld\nfastfake_connections_total %ld\n", metrics_body,
                         served, accepted);
        respond(c, 200, "text/plain; version=0.0.4; charset=utf-8", m, (size_t)n);
        return;
    }
    if (strcmp(method, "GET") == 0 && strcmp(path, "/v1/models") == 0) {
        respond(c, 200, "application/json", models_body, strlen(models_body));
        return;
    }
    static const char nf[] = "{\"error\":{\"message\":\"not found\",\"type\":\"NotFoundError\",\"code\":404}}";
    respond(c, 404, "application/json", nf, sizeof nf - 1);
}

/* Parse and answer every complete request in the input buffer (pipelining allowed). */
static void process_input(conn_t *c) {
    while (c->stream_left == 0) {
        char *start = c->in.p + c->in.off;
        size_t avail = c->in.len - c->in.off;
        char *end = avail >= 4 ? memmem(start, avail, "\r\n\r\n", 4) : NULL;
        if (!end) break;
        size_t head_len = (size_t)(end - start) + 4;
        char method[16] = "", path[256] = "";
        if (sscanf(start, "%15s %255s", method, path) != 2) { c->close_after = 1; respond(c, 400, "text/plain", "", 0); return; }
        size_t clen = 0;
        c->close_after = 0;
        for (char *line = memmem(start, head_len, "\r\n", 2); line && line < end; line = memmem(line + 2, (size_t)(end - line), "\r\n", 2)) {
            char *h = line + 2;
            if (strncasecmp(h, "content-length:", 15) == 0) clen = strtoul(h + 15, NULL, 10);
            else if (strncasecmp(h, "connection:", 11) == 0) {
                char *v = h + 11;
                while (*v == ' ') v++;
                if (strncasecmp(v, "close", 5) == 0) c->close_after = 1;
            } else if (strncasecmp(h, "transfer-encoding:", 18) == 0) {
                c->close_after = 1;
                respond(c, 400, "text/plain", "", 0); /* chunked request bodies are not supported */
                return;
            }
        }
        if (clen > MAX_BODY) { c->close_after = 1; respond(c, 400, "text/plain", "", 0); return; }
        if (avail < head_len + clen) break;
        handle(c, method, path, start + head_len, clen);
        c->in.off += head_len + clen;
    }
    buf_compact(&c->in);
}

static int conn_read(conn_t *c) {
    for (;;) {
        if (c->in.cap - c->in.len < 4096) {
            size_t cap = c->in.cap ? c->in.cap * 2 : 8192;
            c->in.p = realloc(c->in.p, cap);
            if (!c->in.p) { perror("realloc"); exit(1); }
            c->in.cap = cap;
        }
        ssize_t n = read(c->fd, c->in.p + c->in.len, c->in.cap - c->in.len);
        if (n > 0) { c->in.len += (size_t)n; if (c->in.len > MAX_BODY + 65536) return -1; continue; }
        if (n == 0) return -1;
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
        return -1;
    }
}

/* After output drained: finish the connection's turn (close, or parse requests that waited). */
static int conn_after_write(conn_t *c) {
    if (c->out.len) return 0;
    if (c->stream_left == 0 && c->close_after) return -1;
    if (c->stream_left == 0) process_input(c);
    return conn_flush(c);
}

int main(int argc, char **argv) {
    if (argc < 2) { fprintf(stderr, "usage: %s PORT [MODEL]\n", argv[0]); return 2; }
    port = atoi(argv[1]);
    if (argc > 2) model = argv[2];
    signal(SIGPIPE, SIG_IGN);
    build_bodies();

    int ls = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    int one = 1;
    setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((unsigned short)port)};
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(ls, (struct sockaddr *)&addr, sizeof addr) < 0 || listen(ls, 4096) < 0) { perror("bind/listen"); return 1; }
    epfd = epoll_create1(0);
    struct epoll_event lev = {.events = EPOLLIN, .data.ptr = NULL};
    epoll_ctl(epfd, EPOLL_CTL_ADD, ls, &lev);
    fprintf(stderr, "fastfake: model %s on http://127.0.0.1:%d\n", model, port);

    struct epoll_event events[MAX_EVENTS];
    for (;;) {
        int n = epoll_wait(epfd, events, MAX_EVENTS, streaming_head ? 0 : -1);
        if (n < 0 && errno != EINTR) { perror("epoll_wait"); return 1; }
        for (int i = 0; i < n; i++) {
            conn_t *c = events[i].data.ptr;
            if (!c) {
                int fd;
                while ((fd = accept4(ls, NULL, NULL, SOCK_NONBLOCK)) >= 0) {
                    accepted++;
                    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
                    conn_t *nc = calloc(1, sizeof *nc);
                    nc->fd = fd;
                    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = nc};
                    epoll_ctl(epfd, EPOLL_CTL_ADD, fd, &ev);
                }
                continue;
            }
            int dead = 0;
            if (events[i].events & (EPOLLERR | EPOLLHUP)) dead = 1;
            if (!dead && (events[i].events & EPOLLIN)) {
                dead = conn_read(c) < 0;
                if (!dead && c->stream_left == 0 && c->out.len == 0) {
                    process_input(c);
                    dead = conn_flush(c) < 0 || (c->out.len == 0 && c->stream_left == 0 && c->close_after);
                }
            }
            if (!dead && (events[i].events & EPOLLOUT)) dead = conn_flush(c) < 0 || conn_after_write(c) < 0;
            if (dead) conn_close(c);
        }
        /* One SSE event per streaming connection per turn, so that streams interleave like tokens. */
        conn_t *c = streaming_head;
        while (c) {
            conn_t *next = c->next_streaming;
            if (c->out.len == 0) {
                stream_step(c);
                if (c->stream_left == 0) stream_list_remove(c);
                if (conn_flush(c) < 0 || conn_after_write(c) < 0) conn_close(c);
            }
            c = next;
        }
    }
}
