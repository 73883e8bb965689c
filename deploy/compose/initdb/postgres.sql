-- Runs once, when the postgres container initialises its data directory.
-- The capture role: REPLICATION for the slot, SELECT for the bootstrap server's seed.
CREATE ROLE changebus WITH LOGIN REPLICATION PASSWORD 'changebus-demo';
CREATE DATABASE shop OWNER postgres;
\connect shop
CREATE TABLE public.customers (id bigint PRIMARY KEY, name text NOT NULL, email text);
CREATE TABLE public.orders (
    id bigint PRIMARY KEY,
    customer_id bigint NOT NULL REFERENCES public.customers (id),
    amount numeric(12, 2) NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
GRANT SELECT ON ALL TABLES IN SCHEMA public TO changebus;
-- the publication is created here by its owner; the relay only reads it
CREATE PUBLICATION changebus FOR TABLE public.customers, public.orders;
INSERT INTO public.customers VALUES (1, 'Ada', 'ada@example.com'), (2, 'Grace', NULL);
INSERT INTO public.orders (id, customer_id, amount) VALUES (1, 1, 12.50), (2, 2, 99.00);
