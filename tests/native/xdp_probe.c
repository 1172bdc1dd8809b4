/* What a datagram costs on an emulated host's link, through AF_XDP against the UDP sockets the
 * core uses: one sender, one receiver, on the two ends of a veth pair at MTU 9000, 8,972-byte
 * UDP datagrams paced at a given rate. The UDP path sends GSO batches of 7 and reads with
 * UDP_GRO (as overcast/native/common/udp.c does); the AF_XDP path binds one socket to queue 0
 * in copy mode with multi-buffer frames (veth offers no zero-copy), a 23-instruction XDP
 * program steering the port to it (loaded and attached through bpf(), detached when the link's
 * descriptor closes, at exit or crash), and copies each payload out of the UMEM as a read from
 * a socket does. Prints each side's thread CPU per datagram. tools/xdp_probe builds it, makes
 * the namespaces and runs every pairing.
 *
 *   xdp_probe rx-udp PORT SECONDS | rx-xdp IFNAME PORT SECONDS
 *   xdp_probe tx-udp DST PORT SECONDS MBIT | tx-xdp IFNAME SRC DST DSTMAC PORT SECONDS MBIT
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <linux/bpf.h>
#include <linux/if_link.h>
#include <linux/if_xdp.h>
#include <linux/udp.h>
#include <net/if.h>
#include <netinet/in.h>
#include <netinet/ip.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#ifndef XDP_USE_SG
#define XDP_USE_SG (1 << 4)
#endif
#ifndef XDP_PKT_CONTD
#define XDP_PKT_CONTD (1 << 0)
#endif
#ifndef SOL_XDP
#define SOL_XDP 283
#endif
#ifndef SOL_UDP
#define SOL_UDP 17
#endif
#ifndef UDP_GRO
#define UDP_GRO 104
#endif
#ifndef UDP_SEGMENT
#define UDP_SEGMENT 103
#endif

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec / 1e9; }
static double thread_cpu(void) { struct timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec + t.tv_nsec / 1e9; }
static void pace(double due) {
    double d = due - now(); if (d <= 0) return;
    struct timespec t = {(time_t)d, (long)((d - (time_t)d) * 1e9)}; nanosleep(&t, NULL);
}
static void die(const char *m) { perror(m); exit(1); }
static long bpf(int cmd, union bpf_attr *a) { return syscall(__NR_bpf, cmd, a, sizeof *a); }

#define INSN(c, d, s, o, i) ((struct bpf_insn){.code = (c), .dst_reg = (d), .src_reg = (s), .off = (o), .imm = (i)})

static int load_prog(int map_fd, int lo, int hi) {
    struct bpf_insn p[] = {
        INSN(BPF_LDX | BPF_MEM | BPF_W, 2, 1, 0, 0),
        INSN(BPF_LDX | BPF_MEM | BPF_W, 3, 1, 4, 0),
        INSN(BPF_ALU64 | BPF_MOV | BPF_X, 4, 2, 0, 0),
        INSN(BPF_ALU64 | BPF_ADD | BPF_K, 4, 0, 0, 42),
        INSN(BPF_JMP | BPF_JGT | BPF_X, 4, 3, 16, 0),        /* -> pass (idx 21) */
        INSN(BPF_LDX | BPF_MEM | BPF_H, 5, 2, 12, 0),
        INSN(BPF_JMP | BPF_JNE | BPF_K, 5, 0, 14, 0x0008),
        INSN(BPF_LDX | BPF_MEM | BPF_B, 5, 2, 14, 0),
        INSN(BPF_JMP | BPF_JNE | BPF_K, 5, 0, 12, 0x45),
        INSN(BPF_LDX | BPF_MEM | BPF_B, 5, 2, 23, 0),
        INSN(BPF_JMP | BPF_JNE | BPF_K, 5, 0, 10, 17),
        INSN(BPF_LDX | BPF_MEM | BPF_H, 5, 2, 36, 0),
        INSN(BPF_ALU | BPF_END | BPF_TO_BE, 5, 0, 0, 16),
        INSN(BPF_JMP | BPF_JLT | BPF_K, 5, 0, 7, lo),
        INSN(BPF_JMP | BPF_JGT | BPF_K, 5, 0, 6, hi),
        INSN(BPF_LDX | BPF_MEM | BPF_W, 2, 1, 16, 0),
        INSN(BPF_LD | BPF_DW | BPF_IMM, 1, BPF_PSEUDO_MAP_FD, 0, map_fd),
        INSN(0, 0, 0, 0, 0),
        INSN(BPF_ALU64 | BPF_MOV | BPF_K, 3, 0, 0, XDP_PASS),
        INSN(BPF_JMP | BPF_CALL, 0, 0, 0, BPF_FUNC_redirect_map),
        INSN(BPF_JMP | BPF_EXIT, 0, 0, 0, 0),
        INSN(BPF_ALU64 | BPF_MOV | BPF_K, 0, 0, 0, XDP_PASS),
        INSN(BPF_JMP | BPF_EXIT, 0, 0, 0, 0),
    };
    static char log[65536];
    union bpf_attr a; memset(&a, 0, sizeof a);
    a.prog_type = BPF_PROG_TYPE_XDP;
    a.insn_cnt = sizeof p / sizeof p[0];
    a.insns = (uint64_t)(uintptr_t)p;
    a.license = (uint64_t)(uintptr_t)"GPL";
    a.log_level = 1; a.log_size = sizeof log; a.log_buf = (uint64_t)(uintptr_t)log;
    a.prog_flags = BPF_F_XDP_HAS_FRAGS;
    a.expected_attach_type = BPF_XDP;
    int fd = bpf(BPF_PROG_LOAD, &a);
    if (fd < 0) { fprintf(stderr, "%s\n", log); die("prog load"); }
    return fd;
}

enum { NFRAMES = 8192, FRAME = 4096, RING = 4096 };
typedef struct { uint32_t *prod, *cons; void *desc; uint32_t mask, cached; } ring;
static void map_ring(int fd, ring *r, struct xdp_ring_offset *o, size_t esz, off_t pgoff) {
    uint8_t *m = mmap(NULL, o->desc + RING * esz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, pgoff);
    if (m == MAP_FAILED) die("mmap ring");
    r->prod = (uint32_t *)(m + o->producer); r->cons = (uint32_t *)(m + o->consumer);
    r->desc = m + o->desc; r->mask = RING - 1;
}

typedef struct { int fd; uint8_t *umem; ring fill, comp, rx, tx; } xsk;

static void xsk_open(xsk *x, int ifindex, int rx, int tx) {
    x->fd = socket(AF_XDP, SOCK_RAW, 0); if (x->fd < 0) die("xsk socket");
    x->umem = mmap(NULL, (size_t)NFRAMES * FRAME, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    /* the kernel's xdp_umem_reg of 6.8 on, tx_metadata_len 0: no padding for it to read */
    struct { uint64_t addr, len; uint32_t chunk, headroom, flags, tx_metadata_len; } reg;
    memset(&reg, 0, sizeof reg);
    reg.addr = (uintptr_t)x->umem;
    reg.len = (uint64_t)NFRAMES * FRAME;
    reg.chunk = FRAME;
    if (setsockopt(x->fd, SOL_XDP, XDP_UMEM_REG, &reg, sizeof reg)) die("umem reg");
    int n = RING;
    if (setsockopt(x->fd, SOL_XDP, XDP_UMEM_FILL_RING, &n, 4) || setsockopt(x->fd, SOL_XDP, XDP_UMEM_COMPLETION_RING, &n, 4)) die("fq/cq");
    if (rx && setsockopt(x->fd, SOL_XDP, XDP_RX_RING, &n, 4)) die("rx ring");
    if (tx && setsockopt(x->fd, SOL_XDP, XDP_TX_RING, &n, 4)) die("tx ring");
    struct xdp_mmap_offsets off; socklen_t ol = sizeof off;
    if (getsockopt(x->fd, SOL_XDP, XDP_MMAP_OFFSETS, &off, &ol)) die("offsets");
    map_ring(x->fd, &x->fill, &off.fr, 8, XDP_UMEM_PGOFF_FILL_RING);
    map_ring(x->fd, &x->comp, &off.cr, 8, XDP_UMEM_PGOFF_COMPLETION_RING);
    if (rx) map_ring(x->fd, &x->rx, &off.rx, sizeof(struct xdp_desc), XDP_PGOFF_RX_RING);
    if (tx) map_ring(x->fd, &x->tx, &off.tx, sizeof(struct xdp_desc), XDP_PGOFF_TX_RING);
    struct sockaddr_xdp sa = {.sxdp_family = AF_XDP, .sxdp_ifindex = ifindex, .sxdp_queue_id = 0, .sxdp_flags = XDP_COPY | XDP_USE_SG};
    if (bind(x->fd, (struct sockaddr *)&sa, sizeof sa)) die("xsk bind");
}

/* One line a side: "<side> <datagrams> <Mbit/s> <us of thread CPU per datagram>". */
static void report(const char *what, uint64_t dgrams, uint64_t bytes, double cpu, double secs) {
    printf("%s %lu %.0f %.2f\n", what, (unsigned long)dgrams, secs > 0 ? bytes * 8 / secs / 1e6 : 0,
           dgrams ? cpu / dgrams * 1e6 : 0);
}

static int rx_xdp(const char *ifname, int port, double seconds) {
    int ifindex = if_nametoindex(ifname); if (!ifindex) die("ifindex");
    union bpf_attr a; memset(&a, 0, sizeof a);
    a.map_type = BPF_MAP_TYPE_XSKMAP; a.key_size = 4; a.value_size = 4; a.max_entries = 64;
    int map = bpf(BPF_MAP_CREATE, &a); if (map < 0) die("map");
    int prog = load_prog(map, port, port);
    memset(&a, 0, sizeof a);
    a.link_create.prog_fd = prog; a.link_create.target_ifindex = ifindex; a.link_create.attach_type = BPF_XDP;
    int link = bpf(BPF_LINK_CREATE, &a); if (link < 0) die("link create");
    xsk x; xsk_open(&x, ifindex, 1, 0);
    uint32_t key = 0, val = x.fd;
    memset(&a, 0, sizeof a); a.map_fd = map; a.key = (uintptr_t)&key; a.value = (uintptr_t)&val;
    if (bpf(BPF_MAP_UPDATE_ELEM, &a)) die("map update");
    uint64_t *fq = x.fill.desc;
    for (uint32_t i = 0; i < RING; i++) fq[i] = (uint64_t)i * FRAME;
    __atomic_store_n(x.fill.prod, RING, __ATOMIC_RELEASE);
    static uint8_t buf[65536]; size_t have = 0;
    uint64_t dgrams = 0, bytes = 0; double t0 = 0, c0 = 0, end = now() + seconds + 30, last = 0;
    printf("ready\n"); fflush(stdout);  /* the sender starts on this line */
    struct pollfd pf = {x.fd, POLLIN, 0};
    uint32_t fprod = RING;
    for (;;) {
        uint32_t prod = __atomic_load_n(x.rx.prod, __ATOMIC_ACQUIRE), cons = *x.rx.cons;
        if (prod == cons) {
            if (t0 && now() - last > 1.0) break;
            if (now() > end) break;
            poll(&pf, 1, 100); continue;
        }
        if (!t0) { t0 = now(); c0 = thread_cpu(); }
        struct xdp_desc *d = x.rx.desc;
        for (; cons != prod; cons++) {
            struct xdp_desc *e = &d[cons & x.rx.mask];
            if (have + e->len <= sizeof buf) memcpy(buf + have, x.umem + e->addr, e->len);
            have += e->len;
            if (!(e->options & XDP_PKT_CONTD)) { dgrams++; bytes += have - 42; have = 0; }
            fq[fprod++ & x.fill.mask] = e->addr & ~(uint64_t)(FRAME - 1);
        }
        __atomic_store_n(x.rx.cons, cons, __ATOMIC_RELEASE);
        __atomic_store_n(x.fill.prod, fprod, __ATOMIC_RELEASE);
        last = now();
    }
    report("rx-xdp", dgrams, bytes, thread_cpu() - c0, last - t0);
    close(x.fd); close(link); close(prog); close(map);
    return 0;
}

static int rx_udp(int port, double seconds) {
    int fd = socket(AF_INET, SOCK_DGRAM, 0); int one = 1, big = 32 << 20;
    setsockopt(fd, SOL_UDP, UDP_GRO, &one, sizeof one);
    setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &big, sizeof big);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port)};
    if (bind(fd, (struct sockaddr *)&sa, sizeof sa)) die("bind");
    static uint8_t buf[65536]; char cbuf[64];
    uint64_t dgrams = 0, bytes = 0; double t0 = 0, c0 = 0, end = now() + seconds + 30, last = 0;
    printf("ready\n"); fflush(stdout);
    struct pollfd pf = {fd, POLLIN, 0};
    for (;;) {
        struct iovec iov = {buf, sizeof buf};
        struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf, .msg_controllen = sizeof cbuf};
        ssize_t n = recvmsg(fd, &m, MSG_DONTWAIT);
        if (n < 0) {
            if (t0 && now() - last > 1.0) break;
            if (now() > end) break;
            poll(&pf, 1, 100); continue;
        }
        if (!t0) { t0 = now(); c0 = thread_cpu(); }
        int seg = n;
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c))
            if (c->cmsg_level == SOL_UDP && c->cmsg_type == UDP_GRO) memcpy(&seg, CMSG_DATA(c), sizeof seg);
        dgrams += (n + seg - 1) / seg; bytes += n; last = now();
    }
    report("rx-udp", dgrams, bytes, thread_cpu() - c0, last - t0);
    return 0;
}

/* `mbit` Mbit/s of datagrams in GSO batches of 7 (the most under one UDP payload) */
static int tx_udp(const char *dst, int port, double seconds, double mbit) {
    const int batch = 7;
    int fd = socket(AF_INET, SOCK_DGRAM, 0);
    int seg = 8972; int big = 32 << 20;
    setsockopt(fd, SOL_SOCKET, SO_SNDBUFFORCE, &big, sizeof big);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port)};
    inet_pton(AF_INET, dst, &sa.sin_addr);
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa)) die("connect");
    if (setsockopt(fd, SOL_UDP, UDP_SEGMENT, &seg, sizeof seg)) die("gso");
    static uint8_t buf[8972 * 7]; memset(buf, 7, sizeof buf);
    double t0 = now(), c0 = thread_cpu(); uint64_t dgrams = 0;
    while (now() - t0 < seconds) {
        double due = t0 + dgrams * 8972.0 * 8 / (mbit * 1e6);
        pace(due);
        if (send(fd, buf, (size_t)8972 * batch, 0) < 0) { if (errno == ENOBUFS || errno == EAGAIN) continue; die("send"); }
        dgrams += batch;
    }
    report("tx-udp", dgrams, dgrams * 8972, thread_cpu() - c0, now() - t0);
    return 0;
}

static uint16_t csum(const void *p, size_t n) {
    const uint8_t *b = p; uint32_t s = 0;
    for (size_t i = 0; i + 1 < n; i += 2) s += (b[i] << 8) | b[i + 1];
    while (s >> 16) s = (s & 0xffff) + (s >> 16);
    return htons(~s);
}

/* `mbit` Mbit/s of datagrams through AF_XDP, each in 3 frames, kicked 7 at a time */
static int tx_xdp(const char *ifname, const char *src, const char *dst, const char *dmac, int port, double seconds, double mbit) {
    int ifindex = if_nametoindex(ifname); if (!ifindex) die("ifindex");
    xsk x; xsk_open(&x, ifindex, 0, 1);
    uint8_t mac[6], smac[6] = {2, 0, 0, 0, 0, 1};
    sscanf(dmac, "%hhx:%hhx:%hhx:%hhx:%hhx:%hhx", &mac[0], &mac[1], &mac[2], &mac[3], &mac[4], &mac[5]);
    uint8_t hdr[42]; memcpy(hdr, mac, 6); memcpy(hdr + 6, smac, 6); hdr[12] = 8; hdr[13] = 0;
    struct iphdr *ip = (struct iphdr *)(hdr + 14);
    memset(ip, 0, 20); ip->version = 4; ip->ihl = 5; ip->ttl = 64; ip->protocol = 17; ip->tot_len = htons(20 + 8 + 8972);
    inet_pton(AF_INET, src, &ip->saddr); inet_pton(AF_INET, dst, &ip->daddr); ip->check = csum(ip, 20);
    struct udphdr *u = (struct udphdr *)(hdr + 34); u->source = htons(port); u->dest = htons(port); u->len = htons(8 + 8972); u->check = 0;
    uint32_t free_frames[NFRAMES]; uint32_t nfree = 0;
    for (uint32_t i = 0; i < NFRAMES; i++) free_frames[nfree++] = i;
    uint32_t tprod = 0; uint64_t dgrams = 0; double t0 = now(), c0 = thread_cpu();
    struct xdp_desc *td = x.tx.desc; uint64_t *cq = x.comp.desc;
    while (now() - t0 < seconds) {
        /* reclaim */
        uint32_t cp = __atomic_load_n(x.comp.prod, __ATOMIC_ACQUIRE), cc = *x.comp.cons;
        for (; cc != cp; cc++) free_frames[nfree++] = (uint32_t)(cq[cc & x.comp.mask] / FRAME);
        __atomic_store_n(x.comp.cons, cc, __ATOMIC_RELEASE);
        double due = t0 + dgrams * 8972.0 * 8 / (mbit * 1e6);
        pace(due);
        uint32_t tcons = __atomic_load_n(x.tx.cons, __ATOMIC_ACQUIRE);
        for (int k = 0; k < 7 && nfree >= 3 && tprod - tcons + 3 <= RING; k++) {
            size_t left = 9014;
            for (int c = 0; c < 3; c++) {
                uint32_t f = free_frames[--nfree];
                uint8_t *p = x.umem + (size_t)f * FRAME;
                size_t len = left < 3840 ? left : 3840;
                if (c == 0) { memcpy(p, hdr, 42); memset(p + 42, 7, len - 42); } else memset(p, 7, len);
                td[tprod & x.tx.mask] = (struct xdp_desc){(uint64_t)f * FRAME, (uint32_t)len, c < 2 ? XDP_PKT_CONTD : 0};
                tprod++; left -= len;
            }
            dgrams++;
        }
        __atomic_store_n(x.tx.prod, tprod, __ATOMIC_RELEASE);
        /* kicked every turn: the kernel may have left earlier frames in the ring */
        if (sendto(x.fd, NULL, 0, MSG_DONTWAIT, NULL, 0) < 0 && errno != EAGAIN && errno != EBUSY &&
            errno != ENOBUFS)
            die("kick");
    }
    report("tx-xdp", dgrams, dgrams * 8972, thread_cpu() - c0, now() - t0);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 5 && !strcmp(argv[1], "rx-xdp")) return rx_xdp(argv[2], atoi(argv[3]), atof(argv[4]));
    if (argc == 4 && !strcmp(argv[1], "rx-udp")) return rx_udp(atoi(argv[2]), atof(argv[3]));
    if (argc == 6 && !strcmp(argv[1], "tx-udp")) return tx_udp(argv[2], atoi(argv[3]), atof(argv[4]), atof(argv[5]));
    if (argc == 9 && !strcmp(argv[1], "tx-xdp"))
        return tx_xdp(argv[2], argv[3], argv[4], argv[5], atoi(argv[6]), atof(argv[7]), atof(argv[8]));
    fprintf(stderr, "usage: see the head of tests/native/xdp_probe.c\n");
    return 2;
}
