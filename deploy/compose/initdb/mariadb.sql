-- Runs once, when the mariadb container initialises its data directory.
-- The capture user: binlog streaming (REPLICATION SLAVE), positions (BINLOG MONITOR,
-- MariaDB's name for REPLICATION CLIENT) and SELECT for seeding.
CREATE DATABASE IF NOT EXISTS shop;
CREATE USER 'changebus'@'%' IDENTIFIED BY 'changebus-demo';
GRANT REPLICATION SLAVE, BINLOG MONITOR, SELECT ON *.* TO 'changebus'@'%';
CREATE TABLE shop.items (id BIGINT PRIMARY KEY, title VARCHAR(200) NOT NULL, stock INT NOT NULL);
INSERT INTO shop.items VALUES (1, 'kettle', 10), (2, 'teapot', 4);
